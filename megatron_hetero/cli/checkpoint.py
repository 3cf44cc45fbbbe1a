"""`megatron-hetero checkpoint`: look into checkpoints written by `train --save`.

    megatron-hetero checkpoint inspect DIR [--iteration N] [--json]

DIR is a `--save` directory (its latest complete checkpoint, or --iteration N) or one `iter_NNNNNNN`
folder. Prints the iteration, consumed samples, the data position, the layout the checkpoint was
saved under, whether every file matches the manifest, and each logical model's tensors with their
global shapes and dtypes (model and optimizer state), and saves that did not complete. Runs no
training and starts no process group. Reads like `train --load`: the manifest (sha256 of every file)
first, then each `.metadata` with the restricted unpickler and the common state (0.19's `common_state`
bytes or 0.16.1's `common.pt`) with `torch.load(weights_only=True)` (`checkpoint.safe_unpickle`: a
crafted file is refused, nothing of it runs). Exit 2 for a missing, corrupt or refused checkpoint, naming the file.
"""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from megatron_hetero.checkpoint.files import read_train_state, saves, verify_manifest

NAME = "checkpoint"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(NAME, help="inspect checkpoints written by train --save")
    actions = p.add_subparsers(dest="action", required=True, metavar="ACTION")
    i = actions.add_parser("inspect", help="iteration, layout and tensor shapes of a checkpoint")
    i.add_argument("dir", help="a --save directory or one of its iter_NNNNNNN folders")
    i.add_argument("--iteration", type=int, default=None, help="this iteration instead of the latest")
    i.add_argument("--json", action="store_true", help="print a JSON document")
    return p


def _locate(path: str, iteration) -> tuple[Path, int | None]:
    p = Path(path)
    m = re.fullmatch(r"iter_(\d+)", p.name)
    if m and iteration is None:
        return p.parent, int(m.group(1))
    return p, iteration


def run(args: argparse.Namespace) -> int:
    from megatron_hetero.compat.startup import import_megatron_core
    from megatron_hetero.training.job import quiet_upstream_warnings

    quiet_upstream_warnings()
    # the checkpoint readers import Megatron-core's dist_checkpointing: without torch's compiler stack,
    # which its fused kernels' decorations would import (compat.startup)
    import_megatron_core()
    from megatron_hetero.checkpoint import save_load as ckpt
    from megatron_hetero.checkpoint.loadable import read_torch_files

    root, iteration = _locate(args.dir, args.iteration)

    d, state = read_train_state(root, iteration)
    verify_manifest(d, state)
    read_torch_files(d, state)
    incomplete = [str(p) for _, p in saves(root)[1]]
    models = {}
    for name in sorted(state.get("modules", {})):
        models[name] = ckpt.tensor_shapes(d / name)
    if args.json:
        print(
            json.dumps(
                {
                    "dir": str(d),
                    "iteration": state["iteration"],
                    "consumed_samples": state.get("consumed_samples"),
                    "data": state.get("data"),
                    "world_size": state.get("world_size"),
                    "layout": state.get("layout_dict"),
                    "incomplete_saves": incomplete,
                    "modules": {
                        n: {
                            "layout_modules": state["modules"][n].get("layout_modules"),
                            "optimizer": state["modules"][n].get("optimizer"),
                            "tensors": {k: {"shape": list(s), "dtype": t} for k, (s, t) in ts.items()},
                        }
                        for n, ts in models.items()
                    },
                },
                indent=1,
            )
        )
        return 0
    print(f"checkpoint {d}")
    print(
        f"iteration {state['iteration']}, consumed samples {state.get('consumed_samples')}, "
        f"data position {json.dumps(state.get('data'))}, saved by {state.get('world_size')} ranks"
    )
    print(f"files: {len(state.get('files', {}))}, all match the manifest (bytes, sha256)")
    for p in incomplete:
        print(f"incomplete save (killed while saving it): {p}")
    print("layout it was saved under:")
    for line in str(state.get("layout", "")).rstrip().splitlines():
        print(f"  {line}")
    for name, ts in models.items():
        rec = state["modules"][name]
        n_params = sum(_numel(s) for k, (s, _) in ts.items() if not k.startswith("optimizer."))
        print(
            f"model {name} (layout modules {', '.join(rec.get('layout_modules', []))}; optimizer "
            f"{rec.get('optimizer') or 'none'}): {len(ts)} tensors, {n_params} parameters"
        )
        width = max((len(k) for k in ts), default=0)
        for key, (shape, dtype) in ts.items():
            print(f"  {key:<{width}}  {'x'.join(map(str, shape)) or 'scalar'}  {dtype}")
    return 0


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n
