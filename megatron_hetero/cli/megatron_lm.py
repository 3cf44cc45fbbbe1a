"""`megatron-hetero megatron-lm`: Megatron-LM's own training scripts with per-module layouts.

megatron-hetero megatron-lm check DIR [--apply | --revert]
    says whether DIR is a Megatron-LM tree at a supported tag and whether the plugin's patches
    (patches/megatron-lm/<tag>/) are applied; --apply applies them, --revert removes them.
    Exit 0 when the tree is supported and patched (or, with --revert, unpatched); 2 with the
    reason otherwise (not a Megatron-LM tree, unsupported tag, locally modified files, patches
    not applied, a patch that does not apply cleanly).
megatron-hetero megatron-lm run SCRIPT [ARGS...]
    runs SCRIPT (e.g. DIR/pretrain_vlm.py) as this rank (under torchrun/srun), with the CPU
    redirections for Megatron-LM when no GPU is present; the same as
    `python -m megatron_hetero.megatron_lm.run SCRIPT ARGS...`.
"""

from __future__ import annotations

import argparse
from megatron_hetero.megatron_lm.run import run_script
from megatron_hetero.megatron_lm.tree import apply_patches, check_tree

NAME = "megatron-lm"


def add_parser(sub: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = sub.add_parser(
        NAME, help="Megatron-LM's pretrain_vlm.py / pretrain_gpt.py with per-module layouts (check/apply patches, run)"
    )
    actions = p.add_subparsers(dest="megatron_lm_action", required=True, metavar="ACTION")
    c = actions.add_parser("check", help="is DIR a supported Megatron-LM tree, are the patches applied")
    c.add_argument("dir", help="the Megatron-LM checkout")
    g = c.add_mutually_exclusive_group()
    g.add_argument("--apply", action="store_true", help="apply the patches (checked first, all or nothing)")
    g.add_argument("--revert", action="store_true", help="remove the patches")
    r = actions.add_parser("run", help="run a Megatron-LM script as this rank (CPU redirections without a GPU)")
    r.add_argument("script", help="e.g. DIR/pretrain_vlm.py")
    r.add_argument("script_args", nargs=argparse.REMAINDER, help="the script's own arguments")
    return p


def run(args: argparse.Namespace) -> int:
    if args.megatron_lm_action == "run":
        run_script(args.script, args.script_args)
        return 0

    if args.apply or args.revert:
        st = apply_patches(args.dir, reverse=args.revert)
    else:
        st = check_tree(args.dir)
    if not st.supported:
        raise ValueError(st.reason)
    state = "applied" if st.applied else "not applied"
    print(f"{st.path}: Megatron-LM at {st.tag} (supported); megatron-hetero patches {state}")
    for name, v in sorted(st.files.items()):
        print(f"  {name}: {v}")
    if args.revert:
        return 0
    if not st.applied:
        raise ValueError(
            f"the megatron-hetero patches are not applied in {st.path}; apply them with "
            f"`megatron-hetero megatron-lm check {st.path} --apply`"
        )
    return 0
