"""`python -m distqa ...`, which is also what torchrun runs: `torchrun ... -m distqa train ...`."""

# First, before torch: the process that started this one, for a torchrun worker's watch of its agent.
import distqa.parent_watch  # noqa: F401, I001
from distqa.cli import run_and_exit

if __name__ == "__main__":
    run_and_exit()
