"""A user's Megatron-LM checkout: which tag, whether the plugin's patches are applied, applying them.

The patches live in the source tree at `patches/megatron-lm/<tag>/*.patch` (unified diffs, `-p1`).
A tree is recognised by the SHA-256 of the files the patches touch: each file matches either the
tag's pristine content or its patched content; anything else is an unsupported (or locally
modified) tree; a tree at a tag an earlier release supported (`RETIRED`) is named with the release it
needs. Pure file inspection; applying runs `patch -p1` (or `git apply` where `patch` is
missing) in the tree.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

#: tag -> file -> (sha256 pristine, sha256 patched)
SUPPORTED: dict[str, dict[str, tuple[str, str]]] = {
    "core_v0.19.0": {
        "pretrain_vlm.py": (
            "ce3f700023c0415ab9d54a6831231131a403ec69848e2f3235220d39ec96e36d",
            "4793bd5e0bc49f75f2b2b938b665057c2c304f48e272cf4a0a6b8daba2686e4f",
        ),
        "pretrain_gpt.py": (
            "7283c4aeb5a00c694bbf2930527a184fc0d5f607f548c74707c71cc240d05fae",
            "3687a7b69b40bb0e38bda7c5b38f98678dd7d7d46c7aaff8442aabbc614db474",
        ),
    }
}

#: Tags an earlier release supported, recognised only to say so: tag -> (file -> (sha256 pristine,
#: sha256 patched by that release), the release and Megatron-core it needs).
RETIRED: dict[str, tuple[dict[str, tuple[str, str]], str]] = {
    "core_v0.16.1": (
        {
            "pretrain_vlm.py": (
                "0eb84b159e94ccb6b5c38803debcec27c05323ed2bef50b3b4d04a06cb3e644d",
                "8b529555c511a2732045fdf4fe627bb2f4327d70c68291a36f22f9d91c6437f9",
            ),
            "pretrain_gpt.py": (
                "5a5b8fe909610892146e4d2ef5b303bd9b73bb31dfc96d73f2d0afb8937d4b22",
                "800463ff6090835fcab947cccb08465ffa4bf692b26bb8636324fe998da5b55a",
            ),
        },
        "megatron-hetero 0.1.0 with megatron-core 0.16.1",
    ),
}


def patches_dir(tag: str) -> Path:
    """`patches/megatron-lm/<tag>/` of this source tree; ValueError if it is not there (installed
    without the source tree)."""
    d = Path(__file__).resolve().parents[2] / "patches" / "megatron-lm" / tag
    if not d.is_dir():
        raise ValueError(f"the patch files for {tag} are not at {d} (run from a megatron-hetero source checkout)")
    return d


def patch_files(tag: str) -> list[Path]:
    return sorted(patches_dir(tag).glob("*.patch"))


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


@dataclass
class TreeStatus:
    """What `check` found: `tag` (None: not a supported tree), per file 'pristine'/'patched', and
    the reason when the tree is not usable."""

    path: Path
    tag: Optional[str] = None
    files: dict[str, str] = field(default_factory=dict)
    reason: Optional[str] = None

    @property
    def supported(self) -> bool:
        return self.tag is not None and self.reason is None

    @property
    def applied(self) -> bool:
        return self.supported and all(v == "patched" for v in self.files.values())

    @property
    def pristine(self) -> bool:
        return self.supported and all(v == "pristine" for v in self.files.values())


def check_tree(path: str | Path) -> TreeStatus:
    """Inspect the Megatron-LM tree at `path` (see the module docstring)."""
    root = Path(path).resolve()
    st = TreeStatus(root)
    if not root.is_dir():
        st.reason = f"{root} is not a directory"
        return st
    missing = [
        p for p in ("pretrain_vlm.py", "pretrain_gpt.py", "megatron/training/training.py") if not (root / p).is_file()
    ]
    if missing:
        st.reason = f"{root} is not a Megatron-LM tree (missing {', '.join(missing)})"
        return st
    for tag, files in SUPPORTED.items():
        found = {}
        for name, (pristine, patched) in files.items():
            h = _sha256(root / name)
            found[name] = "pristine" if h == pristine else "patched" if h == patched else None
        if all(v is not None for v in found.values()):
            st.tag, st.files = tag, found
            if len(set(found.values())) > 1:
                st.reason = (
                    f"the patches are applied to only some files ({found}); restore the tree "
                    f"(git checkout {' '.join(files)}) and apply again"
                )
            return st
        if any(v is not None for v in found.values()):
            bad = [n for n, v in found.items() if v is None]
            st.reason = (
                f"{', '.join(bad)} match neither {tag} nor its patched version (locally modified?); "
                f"supported tags: {', '.join(SUPPORTED)}"
            )
            return st
    for tag, (files, needs) in RETIRED.items():
        if all(_sha256(root / name) in hashes for name, hashes in files.items()):
            st.reason = (
                f"{root} is Megatron-LM at {tag}, which this megatron-hetero no longer supports (it runs on "
                f"megatron-core 0.19; supported tags: {', '.join(SUPPORTED)}): use {needs} for it, "
                f"or check out {' or '.join(SUPPORTED)}"
            )
            return st
    st.reason = (
        f"{root}: pretrain_vlm.py/pretrain_gpt.py match no supported tag ({', '.join(SUPPORTED)}); "
        f"check out one of them"
    )
    return st


def _patch_cmd(patch: Path, reverse: bool, dry_run: bool) -> list[str]:
    if shutil.which("patch"):
        cmd = ["patch", "-p1", "--batch", "--silent", "-i", str(patch)]
        if reverse:
            cmd.append("-R")
        if dry_run:
            cmd.append("--dry-run")
        return cmd
    if shutil.which("git"):
        cmd = ["git", "apply"]
        if reverse:
            cmd.append("-R")
        if dry_run:
            cmd.append("--check")
        return cmd + [str(patch)]
    raise ValueError("neither `patch` nor `git` is installed: apply the patches by hand")


def apply_patches(path: str | Path, reverse: bool = False) -> TreeStatus:
    """Apply (or with `reverse`, remove) the tag's patches in the tree; checks every patch first, so a
    tree is never left half-patched by a patch that does not apply. ValueError with the reason."""
    st = check_tree(path)
    if not st.supported:
        raise ValueError(st.reason)
    if (st.applied and not reverse) or (st.pristine and reverse):
        return st
    patches = patch_files(st.tag)
    for dry in (True, False):
        for p in reversed(patches) if reverse else patches:
            r = subprocess.run(_patch_cmd(p, reverse, dry), cwd=st.path, capture_output=True, text=True)
            if r.returncode:
                raise ValueError(
                    f"{p.name} does not {'reverse' if reverse else 'apply'} cleanly in {st.path}: "
                    f"{(r.stdout + r.stderr).strip()[:500]}"
                )
    return check_tree(path)
