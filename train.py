#!/usr/bin/env python3
"""Train on a task of batchrl's configs from a checkout: ``python train.py --config halfcheetah``.

The same command as ``batchrl-train`` (``batchrl/train.py``); ``--help`` lists
the options, configs and keys.
"""

import sys

from batchrl.train import main

if __name__ == "__main__":
    sys.exit(main(command="python train.py"))
