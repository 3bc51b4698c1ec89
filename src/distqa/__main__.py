"""`python -m distqa ...`, which is also what torchrun runs: `torchrun ... -m distqa train ...`."""

from distqa.cli import run_and_exit

if __name__ == "__main__":
    run_and_exit()
