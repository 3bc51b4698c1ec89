"""`python -m distqa ...`, which is also what torchrun runs: `torchrun ... -m distqa train ...`."""

from distqa.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
