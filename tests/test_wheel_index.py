"""Per-backend package indexes (scripts/make_index.py) and what a user gets from them.

The end-to-end test builds both wheels, serves the indexes on loopback and installs with a plain
``pip install --index-url .../cpu/ --extra-index-url .../normal/ llamacrab`` into a fresh
virtual environment, then generates tokens there.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import http.server
import json
import os
import re
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator
from email.parser import Parser
from pathlib import Path

import pytest

from support import REPO as ROOT
from support import load_repo_module

make_index = load_repo_module("scripts/make_index.py")

PIN = json.loads((ROOT / "llamacrab-sys" / "pin.json").read_text())["llama_cpp_commit"]


def fake_wheel(
    directory: Path, name: str, version: str, tag: str, build_info: dict[str, object] | None
) -> Path:
    """A minimal wheel: METADATA and, for llamacrab_sys, the recorded build info."""
    directory.mkdir(parents=True, exist_ok=True)
    dist = f"{name.replace('-', '_')}-{version}"
    path = directory / f"{dist}-{tag}.whl"
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr(
            f"{dist}.dist-info/METADATA",
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Python: >=3.10\n",
        )
        if build_info is not None:
            archive.writestr("llamacrab_sys/_build_info.json", json.dumps(build_info))
    return path


SYS_TAG = "cp311-cp311-manylinux_2_28_x86_64"
CUDA12 = {
    "backend": "cuda",
    "compilers": {"nvcc": "/usr/bin/nvcc Cuda compilation tools, release 12.4, V12.4.131"},
}


@pytest.mark.parametrize(
    ("info", "index"),
    [
        ({"backend": "cpu"}, "cpu"),
        ({"backend": "vulkan"}, "vulkan"),
        ({"backend": "metal"}, "cpu"),
        (CUDA12, "cu12x"),
        ({"backend": "cuda", "cuda_version": "13.0", "compilers": {}}, "cu13x"),
    ],
)
def test_backend_read_from_the_wheel(tmp_path: Path, info: dict[str, object], index: str) -> None:
    wheel = fake_wheel(tmp_path / "in", "llamacrab-sys", "0.1.0", SYS_TAG, info)
    assert make_index.build(tmp_path / "site", [wheel]) == {index: [wheel.name]}
    page = (tmp_path / "site" / index / "llamacrab-sys" / "index.html").read_text()
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    assert f'href="{wheel.name}#sha256={digest}" data-requires-python="&gt;=3.10"' in page
    root = (tmp_path / "site" / index / "index.html").read_text()
    assert '<a href="llamacrab-sys/">llamacrab-sys</a>' in root


def test_variants_of_one_file_name_land_apart(tmp_path: Path) -> None:
    cpu = fake_wheel(tmp_path / "cpu", "llamacrab-sys", "0.1.0", SYS_TAG, {"backend": "cpu"})
    cuda = fake_wheel(tmp_path / "cuda", "llamacrab-sys", "0.1.0", SYS_TAG, CUDA12)
    pure = fake_wheel(tmp_path / "pure", "llamacrab", "0.1.0", "py3-none-any", None)
    assert cpu.name == cuda.name
    placed = make_index.build(tmp_path / "site", [tmp_path / "cpu", tmp_path / "cuda", pure])
    assert placed == {"cpu": [cpu.name], "cu12x": [cuda.name], "normal": [pure.name]}
    assert (tmp_path / "site/normal/llamacrab/index.html").exists()
    assert not (tmp_path / "site/cpu/llamacrab").exists()


def test_a_second_release_keeps_the_first(tmp_path: Path) -> None:
    first = fake_wheel(tmp_path / "a", "llamacrab-sys", "0.1.0", SYS_TAG, {"backend": "cpu"})
    second = fake_wheel(tmp_path / "b", "llamacrab-sys", "0.1.1", SYS_TAG, {"backend": "cpu"})
    make_index.build(tmp_path / "site", [first])
    make_index.build(tmp_path / "site", [second])
    page = (tmp_path / "site/cpu/llamacrab-sys/index.html").read_text()
    assert first.name in page and second.name in page
    # The same wheel again is a no-op; another file under the same name is refused.
    make_index.build(tmp_path / "site", [second])
    other = fake_wheel(
        tmp_path / "c", "llamacrab-sys", "0.1.1", SYS_TAG, {"backend": "cpu", "x": 1}
    )
    with pytest.raises(make_index.WheelPlacementError, match="different contents"):
        make_index.build(tmp_path / "site", [other])


@pytest.mark.parametrize(
    ("name", "tag", "info", "message"),
    [
        ("llamacrab-sys", SYS_TAG, None, "backend unknown"),
        ("llamacrab-sys", SYS_TAG, {"backend": "hip"}, "no index for backend 'hip'"),
        ("llamacrab-sys", SYS_TAG, {"backend": "cuda", "compilers": {}}, "CUDA version"),
        ("llamacrab", SYS_TAG, None, "only llamacrab-sys may be platform-specific"),
    ],
)
def test_unplaceable_wheels_are_refused(
    tmp_path: Path, name: str, tag: str, info: dict[str, object] | None, message: str
) -> None:
    wheel = fake_wheel(tmp_path, name, "0.1.0", tag, info)
    with pytest.raises(make_index.WheelPlacementError, match=message):
        make_index.build(tmp_path / "site", [wheel])
    assert make_index.main([str(tmp_path / "site"), str(wheel)]) == 1


# --- end to end: real wheels, a real pip, a fresh environment --------------------------------


def relabel(wheel: Path, out_dir: Path, local: str, build_info: dict[str, object]) -> Path:
    """A copy of a llamacrab_sys wheel as another backend's variant: version ``X+local`` and
    the given build info, as a wheel built for that backend would carry them."""
    with zipfile.ZipFile(wheel) as source:
        files = {n: source.read(n) for n in source.namelist()}
    old_dist = next(n.split("/")[0] for n in files if n.endswith(".dist-info/METADATA"))
    version = old_dist.removesuffix(".dist-info").split("-")[1]
    new_dist = old_dist.replace(version, f"{version}+{local}")
    renamed: dict[str, bytes] = {}
    for name, data in files.items():
        if name.endswith("/_build_info.json"):
            data = json.dumps({**json.loads(data), **build_info}).encode()
        if name == f"{old_dist}/METADATA":
            data = re.sub(rb"(?m)^Version: .*$", f"Version: {version}+{local}".encode(), data)
        renamed[name.replace(old_dist, new_dist, 1)] = data
    record = f"{new_dist}/RECORD"
    lines = []
    for name, data in renamed.items():
        if name != record:
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=")
            lines.append(f"{name},sha256={digest.decode()},{len(data)}")
    renamed[record] = ("\n".join([*lines, f"{record},,"]) + "\n").encode()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / wheel.name.replace(f"-{version}-", f"-{version}+{local}-")
    with zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as archive:
        for name, data in renamed.items():
            archive.writestr(name, data)
    return target


def run(args: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    # Nothing of this process's import path may leak into the fresh environment.
    env = {k: v for k, v in (env or os.environ).items() if k != "PYTHONPATH"}
    done = subprocess.run(
        args, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT, check=False
    )
    assert done.returncode == 0, f"{args[:4]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The llamacrab-sys wheel (reusing the cached native build) and the llamacrab wheel."""
    out = tmp_path_factory.mktemp("wheels")
    pip_wheel = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--quiet", "-w"]
    run([*pip_wheel, str(out / "cpu"), str(ROOT / "llamacrab-sys")], timeout=1200)
    run([*pip_wheel, str(out / "pure"), str(ROOT / "llamacrab")], timeout=300)
    (sys_wheel,) = (out / "cpu").glob("llamacrab_sys-*.whl")
    (pure_wheel,) = (out / "pure").glob("llamacrab-*.whl")
    return {"sys": sys_wheel, "pure": pure_wheel}


@pytest.fixture(scope="module")
def site_url(wheels: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The indexes served on loopback: cpu/, normal/ and a CUDA 13 variant in cu13x/."""
    site = tmp_path_factory.mktemp("site")
    variant = relabel(
        wheels["sys"],
        site.parent / "variant",
        "cu130",
        {"backend": "cuda", "cuda_version": "13.0"},
    )
    make_index.build(site, [wheels["sys"], wheels["pure"], variant])
    handler = functools.partial(QuietHandler, directory=str(site))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def runtime_requirements(*wheels: Path) -> list[str]:
    """The wheels' own dependencies, except each other, from their METADATA."""
    requirements = []
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as archive:
            name = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
            meta = Parser().parsestr(archive.read(name).decode())
        requirements += [
            r
            for r in meta.get_all("Requires-Dist", [])
            if "extra ==" not in r and not r.startswith("llamacrab")
        ]
    return requirements


def isolated_pip_env() -> dict[str, str]:
    """Only the command line decides where pip looks: no config file, no PIP_* variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


GENERATE = """
import sys, llamacrab, llamacrab_sys
from llamacrab import Llama
with Llama(sys.argv[1], n_ctx=64) as llm:
    out = llm.create_completion("Hello", max_tokens=4, temperature=0.0)
print(json.dumps({"backend": llamacrab_sys.build_info().backend,
                  "file": llamacrab.__file__, "tokens": out.usage.completion_tokens}))
""".replace("import sys,", "import json, sys,")


def installed(report: Path) -> dict[str, tuple[str, str]]:
    """{name: (version, url)} from a pip installation report."""
    items = json.loads(report.read_text())["install"]
    return {
        i["metadata"]["name"]: (i["metadata"]["version"], i["download_info"]["url"]) for i in items
    }


@pytest.mark.timeout(1800)
def test_pip_install_from_the_indexes(
    wheels: dict[str, Path], site_url: str, tiny_model_path: Path, tmp_path: Path
) -> None:
    venv = tmp_path / "venv"
    run([sys.executable, "-m", "venv", str(venv)], timeout=120)
    py = str(venv / "bin" / "python")
    # llamacrab's other dependencies (numpy, ...) as local wheels: from wherever this machine's
    # pip configuration points (PyPI in CI), fetched before the isolated install.
    deps = tmp_path / "deps"
    pip = [py, "-m", "pip", "--disable-pip-version-check"]
    run(
        [*pip, "download", "--quiet", "-d", str(deps), *runtime_requirements(*wheels.values())], 600
    )

    def install(index: str, report: Path) -> dict[str, tuple[str, str]]:
        run(
            [
                *pip,
                "install",
                "--quiet",
                "--report",
                str(report),
                "--index-url",
                f"{site_url}/{index}/",
                "--extra-index-url",
                f"{site_url}/normal/",
                "--find-links",
                str(deps),
                "llamacrab",
            ],
            timeout=600,
            env=isolated_pip_env(),
        )
        return installed(report)

    got = install("cpu", tmp_path / "cpu.json")
    assert got["llamacrab"] == ("0.1.0", f"{site_url}/normal/llamacrab/{wheels['pure'].name}")
    assert got["llamacrab-sys"] == ("0.1.0", f"{site_url}/cpu/llamacrab-sys/{wheels['sys'].name}")
    assert "numpy" in got
    result = json.loads(run([py, "-c", GENERATE, str(tiny_model_path)], timeout=300))
    assert result["backend"] == "cpu"
    assert 1 <= result["tokens"] <= 4
    assert result["file"].startswith(str(venv)), "llamacrab came from outside the venv"

    # Another backend's variant of a compatible version (0.1.0+cu130) satisfies llamacrab too.
    run([*pip, "uninstall", "--quiet", "-y", "llamacrab", "llamacrab-sys"], timeout=120)
    got = install("cu13x", tmp_path / "cu13x.json")
    version, url = got["llamacrab-sys"]
    assert version == "0.1.0+cu130"
    assert url.startswith(f"{site_url}/cu13x/llamacrab-sys/")
    result = json.loads(run([py, "-c", GENERATE, str(tiny_model_path)], timeout=300))
    assert result["backend"] == "cuda"
    assert 1 <= result["tokens"] <= 4
