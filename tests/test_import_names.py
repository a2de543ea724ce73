"""Import names that cannot collide: the SDK's folder is agents/, its import name prefillshare.agents.

``agents`` is the import name of OpenAI's Agents SDK (openai-agents, in the `frameworks` extra);
pyproject.toml maps the folder to ``prefillshare.agents`` so that both can be installed and used in
one process. The checks that need a clean sys.path run Python in a subprocess with another working
directory: ``python -m pytest`` from the repository root puts the root on sys.path, where the
agents/ folder is found first (and refuses to be imported under that name).
"""
from __future__ import annotations

import importlib
import importlib.util
import json
import re
import socket
import subprocess
import sys
import textwrap
import tomllib
from pathlib import Path

import pytest

import prefillshare.agents

ROOT = Path(__file__).resolve().parent.parent


def _python(code: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=cwd, capture_output=True, text=True,
                          timeout=120)


def test_sdk_is_the_agents_folder_under_its_own_name():
    assert Path(prefillshare.agents.__file__).resolve() == ROOT / "agents" / "__init__.py"
    assert prefillshare.agents.Client.__module__ == "prefillshare.agents.sdk"
    assert prefillshare.agents.Agent.__module__ == "prefillshare.agents.workflow"
    assert issubclass(prefillshare.agents.WorkflowError, prefillshare.agents.PrefillShareError)


def test_sdk_client_works_offline():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # bound, not listening: connections are refused
        with prefillshare.agents.Client(f"http://127.0.0.1:{port}", retries=0) as client:
            with pytest.raises(prefillshare.agents.WorkflowError, match="at least one agent"):
                client.run("context", agents=[])
            with pytest.raises(prefillshare.agents.APIConnectionError):
                client.run("context", agents=[prefillshare.agents.Agent("lookup", "Q: what is the\ncity")])


def test_openai_agents_and_this_sdk_in_one_process(tmp_path):
    """Both SDKs imported side by side, each the right one, from a directory that is not the repository."""
    run = _python(f"""
        import json, sysconfig
        from pathlib import Path
        from importlib.metadata import packages_distributions

        import agents
        import prefillshare.agents

        root = Path({str(ROOT)!r})
        site = Path(sysconfig.get_paths()["purelib"]).resolve()
        oa = Path(agents.__file__).resolve()
        assert site in oa.parents and root / "agents" not in oa.parents, oa  # (.venv may sit in the root)
        assert "openai-agents" in packages_distributions()["agents"], packages_distributions()["agents"]
        assert hasattr(agents.Runner, "run_sync")
        helper = agents.Agent(name="helper", instructions="answer briefly")  # constructing one is offline

        ps = Path(prefillshare.agents.__file__).resolve()
        assert ps == root / "agents" / "__init__.py", ps
        assert prefillshare.agents.Agent is not agents.Agent
        with prefillshare.agents.Client("http://127.0.0.1:9", retries=0) as client:
            try:
                client.run("context", agents=[prefillshare.agents.Agent("lookup", "x", name="a"),
                                              prefillshare.agents.Agent("route", "y", name="a")])
            except prefillshare.agents.WorkflowError as e:
                error = str(e)
        print(json.dumps({{"openai_agent": helper.name, "error": error}}))
    """, tmp_path)
    if run.returncode and "No module named 'agents'" in run.stderr:
        pytest.fail("openai-agents is not installed: it is in the `frameworks` extra (make setup installs it)")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["openai_agent"] == "helper" and "repeat" in out["error"]


def test_agents_does_not_resolve_to_this_repository(tmp_path):
    run = _python("""
        import importlib.util
        spec = importlib.util.find_spec("agents")
        print(spec.origin if spec else "")
    """, tmp_path)
    assert run.returncode == 0, run.stderr
    origin = run.stdout.strip()
    assert origin, "openai-agents is not installed: it is in the `frameworks` extra (make setup installs it)"
    assert ROOT / "agents" not in Path(origin).resolve().parents, origin
    spec = importlib.util.find_spec("prefillshare.agents")
    assert spec is not None and Path(spec.origin).resolve() == ROOT / "agents" / "__init__.py"


def test_the_folder_refuses_the_name_agents():
    """From the repository root the folder is on sys.path as `agents`: importing it so fails loudly."""
    run = _python("import agents", ROOT)
    assert run.returncode != 0
    assert "ImportError" in run.stderr and "prefillshare.agents" in run.stderr, run.stderr


def test_every_package_folder_is_installed_under_the_projects_name():
    """pyproject lists its packages (a renamed one rules out `find`): every package folder of app/ and
    deployments/ is there, as prefillshare.<folder path>, and nothing else."""
    setuptools = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    # src/prefillshare/<folder> is a relative link to each folder: the names resolve on disk
    assert setuptools["package-dir"] == {"": "src"}
    for top in ("app", "deployments", "agents"):
        link = ROOT / "src" / "prefillshare" / top
        assert link.is_symlink() and link.resolve() == ROOT / top and not link.readlink().is_absolute(), link
    folders = {"prefillshare." + ".".join(p.parent.relative_to(ROOT).parts)
               for top in ("app", "deployments") for p in (ROOT / top).rglob("*.py")
               if "__pycache__" not in p.parts}
    listed = set(setuptools["packages"]) - {"prefillshare.agents", "prefillshare"}
    assert {"prefillshare", "prefillshare.agents"} <= set(setuptools["packages"])
    assert listed == folders, (f"[tool.setuptools] packages in pyproject.toml: add {sorted(folders - listed)}, "
                               f"remove {sorted(listed - folders)}")


def test_no_generic_top_level_name_is_installed_or_imported(tmp_path):
    """Outside the repository only prefillshare.* resolves (`app` and `deployments` are names of
    other people's code); inside it no module imports app/ or deployments/ by its folder name (a
    second copy of a module under another name would not share its state; agents/ refuses its bare
    name itself)."""
    run = _python("""
        import importlib.util
        import prefillshare.app.config, prefillshare.deployments.messages, prefillshare.agents
        print([n for n in ("app", "deployments") if importlib.util.find_spec(n) is not None])
    """, tmp_path)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "[]", run.stdout
    bare = []
    for top in ("app", "deployments", "agents", "bench", "tests", "scripts", "examples"):
        for path in sorted((ROOT / top).rglob("*.py")):
            text = path.read_text()
            bare += [f"{path.relative_to(ROOT)}: {line.strip()}" for line in text.splitlines()
                     if re.match(r"\s*(from|import) (app|deployments)(\.| |$)", line)]
    assert not bare, bare
