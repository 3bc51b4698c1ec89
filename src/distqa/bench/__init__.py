"""`distqa bench`: training throughput, scaling and where the step time goes, per world size."""
