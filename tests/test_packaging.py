"""environment.yml and pyproject.toml list the same dependencies."""

import re
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_environment_yml_matches_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    wanted = set(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        wanted |= set(extra)
    pip_section = (ROOT / "environment.yml").read_text().split("- pip:", 1)[1]
    listed = {x.strip() for x in re.findall(r"^\s+- (.+)$", pip_section, re.M)} - {"-e ."}
    assert listed == wanted, f"only in environment.yml: {listed - wanted}; only in pyproject: {wanted - listed}"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    commands = re.findall(r"```bash\n(.*?)\n```", readme, re.S)
    test_cmd = next(c for c in commands if "pytest" in c)
    assert test_cmd.strip() in ci


def test_ci_runs_in_a_fresh_venv():
    # a machine that already holds older packages hides failures the newest allowed releases bring
    ci = (ROOT / ".ci" / "run").read_text()
    venv = ci.index("python3 -m venv")
    assert venv < ci.index("activate") < ci.index('pip install torch==2.13.0 -e ".[test]"')


def test_notebook_kernels_run_the_tests_python():
    # nbval's default kernel is whichever "python3" Jupyter finds (a machine-wide one, say): the
    # notebooks must import the packages of the environment that runs pytest
    from nbval.kernel import CURRENT_ENV_KERNEL_NAME, NbvalKernelspecManager

    addopts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]["addopts"]
    assert "--nbval-current-env" in addopts.split()
    spec = NbvalKernelspecManager().get_kernel_spec(CURRENT_ENV_KERNEL_NAME)
    assert spec.argv[0] == sys.executable
