"""`python -m hp_runtime.train`, as torchrun's `-m` launches it."""

from hp_runtime.train.cli import main

if __name__ == "__main__":
    main()
