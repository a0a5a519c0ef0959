"""What `pip install ddiloco` gets: the package list, the wheel's contents, and a torch-free pipeline compile.

`components/` and `pipelines/` are top-level folders of the repository but install as `ddiloco.components`
and `ddiloco.pipelines` (pyproject's package-dir); nothing may install as a generic top-level `components` or
`pipelines`, and code that imports them by those names works only from a checkout.
"""

import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RENAMED = {"ddiloco.components": "components", "ddiloco.pipelines": "pipelines"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_the_package_list_names_every_package_folder():
    setuptools = _pyproject()["tool"]["setuptools"]
    listed = setuptools["packages"]
    folders = {
        ".".join(init.parent.relative_to(ROOT).parts) for init in (ROOT / "ddiloco").rglob("__init__.py")
    }
    assert len(listed) == len(set(listed)), listed
    assert set(listed) == folders | set(RENAMED)
    assert setuptools["package-dir"] == RENAMED
    for package, folder in RENAMED.items():
        assert (ROOT / folder / "__init__.py").is_file(), package


def _build_wheel(tmp_path: Path) -> Path:
    """Build from a copy of the sources (setuptools writes build/ and *.egg-info next to them)."""
    src = tmp_path / "src"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for folder in ("ddiloco", *RENAMED.values()):
        shutil.copytree(ROOT / folder, src / folder, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    out = tmp_path / "dist"
    code = "import sys, setuptools.build_meta as b; print(b.build_wheel(sys.argv[1]))"
    subprocess.run(
        [sys.executable, "-c", code, str(out)], cwd=src, check=True, capture_output=True, timeout=120
    )
    (wheel,) = out.glob("ddiloco-*.whl")
    return wheel


def test_the_wheel_installs_components_and_pipelines_under_ddiloco_only(tmp_path):
    names = set(zipfile.ZipFile(_build_wheel(tmp_path)).namelist())
    top = {n.split("/")[0] for n in names}
    assert not {"components", "pipelines"} & top, sorted(top)
    for expected in ("ddiloco/components/roles.py", "ddiloco/pipelines/pretrain.yaml", "ddiloco/keys.py"):
        assert expected in names, expected
    packages = {p.replace(".", "/") for p in _pyproject()["tool"]["setuptools"]["packages"]}
    assert {n.rpartition("/")[0] for n in names if n.endswith("/__init__.py")} == packages


def test_compiling_every_pipeline_leaves_torch_out(tmp_path):
    """Outside the checkout (cwd elsewhere), as an installed package is used: the pipelines need kfp, not torch."""
    code = (
        "import sys\n"
        "from ddiloco.pipelines import compile as c\n"
        "for name in c.PIPELINES:\n"
        "    c.compile_pipeline(name, f'{sys.argv[1]}/{name}.yaml')\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] == 'torch')\n"
        "assert not heavy, heavy[:5]\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert sorted(p.name for p in tmp_path.glob("*.yaml")) == ["join.yaml", "pretrain.yaml", "smoke.yaml"]
