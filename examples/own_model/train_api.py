"""The same job from Python: callables instead of import paths.

python train_api.py             # one process, here
python train_api.py --nproc 2   # two workers through torchrun's elastic agent
torchrun --nproc-per-node 2 train_api.py   # every rank runs this script
"""

import argparse

from digitsnet.data import digits
from digitsnet.loss import smoothed_cross_entropy
from digitsnet.model import build

import scaletrain

if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--nproc", type=int, default=None)
    args = parser.parse_args()
    summary = scaletrain.train(
        "config.toml",
        model=build,
        data=digits,
        loss=smoothed_cross_entropy,
        nproc=args.nproc,
        overrides=["train.steps=100"],
    )
    print(
        f"final loss {summary['final_loss']:.4f}, eval {summary['eval']}, "
        f"run directory {summary['run_dir']}"
    )
