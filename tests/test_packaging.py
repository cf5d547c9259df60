"""The package as pip installs it from a wheel, away from the repository: what it reads at run
time (the workflow schema, the demo model) must be inside it."""

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_an_installed_wheel_validates_and_runs_a_workflow_outside_the_repository(tmp_path):
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", str(ROOT),
                    "-w", str(tmp_path / "dist")], check=True, capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("agentflash-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    assert "agentflash/schemas/workflow.schema.json" in names
    assert "agentflash/assets/demo/target/model.safetensors" in names
    assert "agentflash/kernels/token_bitmask.py" in names  # the top-level kernels/ ships
    subprocess.run([*pip, "install", "--no-deps", "--target", str(tmp_path / "site"), str(wheel)],
                   check=True, capture_output=True)
    work = tmp_path / "work"
    work.mkdir()
    for name in ("structured.yaml", "weather_tools.py"):
        shutil.copy(ROOT / "examples" / name, work)
    script = ("import agentflash, sys; from agentflash.cli import main; "
              "assert agentflash.__file__.startswith(sys.argv[1]), agentflash.__file__; "
              "sys.argv[1:2] = []; main()")
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    for args in (["validate", "structured.yaml"],
                 ["generate", "--prompt", "Hi", "--max-tokens", "4", "--json"]):
        done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "site"), *args],
                              cwd=work, env=env, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]


def test_python_m_agentflash_is_the_command(tmp_path):
    done = subprocess.run([sys.executable, "-m", "agentflash", "validate",
                           str(ROOT / "examples" / "structured.yaml")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.startswith(str(ROOT / "examples")), done.stderr
    done = subprocess.run([sys.executable, "-m", "agentflash", "validate", str(tmp_path / "no")],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: ")
