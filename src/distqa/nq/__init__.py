"""The Natural Questions task: BERT-joint model, DummyDataset, and (later) the real data pipeline.

Nothing outside this folder imports it except through the task registry (`distqa.task`).
"""
