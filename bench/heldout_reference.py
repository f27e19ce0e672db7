#!/usr/bin/env python3
"""What classical text models score on example_transformer's held-out text (issue #15's goal).

example_transformer trains on the first 90 % of a text (default the GPL-3) and reports the held-out
loss in nats per character over the last 10 % (examples/transformer_train.cc: n_train = size * 9 / 10).
The issue's goal is <= 1.6. This script prints, for the same split, references that need no
training run:

  - compressors given the training text: (size(train + held-out) - size(train)) * 8 ln 2 / held-out
    characters, for xz -9e, bzip2 -9 and zstd -19 (each adapts to the held-out text as it reads it);
  - PPM (method C escapes with exclusions; Cleary and Witten 1984, Moffat 1990) of orders 2-8,
    trained on the training text: "static" scores the held-out text with the counts of the training
    text only (as the transformer's fixed weights do), "adaptive" also counts each held-out
    character after scoring it (as a compressor does).

  python3 bench/heldout_reference.py [--text=/usr/share/common-licenses/GPL-3]

Pure Python; a few seconds.
"""

import argparse
import math
import shutil
import subprocess
from collections import defaultdict


def compressed_size(cmd, data):
    return len(subprocess.run(cmd, input=data, capture_output=True, check=True).stdout)


def ppm_nats_per_char(train, held, order, adaptive):
    """Mean -ln p over `held` under PPM-C of `order` with exclusions, counts from `train` first."""
    counts = [defaultdict(lambda: defaultdict(int)) for _ in range(order + 1)]

    def count(history, ch):
        for o in range(min(order, len(history)) + 1):
            counts[o][history[len(history) - o:]][ch] += 1

    for i, ch in enumerate(train):
        count(train[max(0, i - order):i], ch)
    text = train + held
    total = 0.0
    for i in range(len(train), len(text)):
        history, ch = text[max(0, i - order):i], text[i]
        p, excluded = 1.0, set()
        for o in range(min(order, len(history)), -1, -1):
            seen = counts[o].get(history[len(history) - o:])
            if not seen:
                continue
            live = {c: n for c, n in seen.items() if c not in excluded}
            if not live:
                continue
            n, distinct = sum(live.values()), len(live)
            if ch in live:
                p *= live[ch] / (n + distinct)
                break
            p *= distinct / (n + distinct)  # escape (method C)
            excluded |= set(live)
        else:
            p *= 1.0 / (256 - len(excluded))  # order -1: uniform over the bytes not yet excluded
        total -= math.log(p)
        if adaptive:
            count(history, ch)
    return total / len(held)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--text", default="/usr/share/common-licenses/GPL-3",
                        help="the text example_transformer trains on (its --text)")
    args = parser.parse_args()
    text = open(args.text, "rb").read()
    n_train = len(text) * 9 // 10
    train, held = text[:n_train], text[n_train:]
    print(f"{args.text}: {len(train)} training and {len(held)} held-out characters; nats/char on the held-out text")
    to_nats = 8 * math.log(2) / len(held)
    for name, cmd in [("xz -9e", ["xz", "-9e", "-c"]), ("bzip2 -9", ["bzip2", "-9", "-c"]),
                      ("zstd -19", ["zstd", "-19", "-c"])]:
        if shutil.which(cmd[0]) is None:
            print(f"  {name:10} (not installed)")
            continue
        given = compressed_size(cmd, train + held) - compressed_size(cmd, train)
        alone = compressed_size(cmd, held)
        print(f"  {name:10} given the training text {given * to_nats:.3f}   alone {alone * to_nats:.3f}")
    for order in (2, 3, 4, 5, 6, 8):
        static = ppm_nats_per_char(train, held, order, adaptive=False)
        adaptive = ppm_nats_per_char(train, held, order, adaptive=True)
        print(f"  PPM-C order {order}  static {static:.3f}   adaptive {adaptive:.3f}")


if __name__ == "__main__":
    main()
