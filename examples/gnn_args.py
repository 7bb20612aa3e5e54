"""The command line the two training examples share (train_gnn.py, train_gnn_jax.py): the code, model
and run sizes.  Each script adds its own options after these."""

import argparse


def training_parser(description, iters_help, dropout_help):
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--distance", type=int, default=5)
    p.add_argument("--rounds", type=int)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--layers", type=int, default=3)
    p.add_argument("--hidden", type=int, default=32)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--p", type=float, default=0.003)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--steps", type=int, default=30, help="steps of the comparison run")
    p.add_argument("--iters", type=int, default=50, help=iters_help)
    p.add_argument("--dropout", type=float, default=0.1, help=dropout_help)
    p.add_argument("--seed", type=int, default=0)
    return p
