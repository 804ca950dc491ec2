"""The pinned archive's tree as the build extracts it: everything a build reads, nothing that
only an npm build of llama.cpp's web UI reads, and every path short enough for Windows."""

from __future__ import annotations

import io
import tarfile
from pathlib import Path

from build_tools import source

# MAX_PATH (260) less a Windows cache root such as C:\Users\<name>\.cache\llamacrab\src\ (~45
# characters with a long user name) and the patched tree's directory name (65).
WINDOWS_PATH_BUDGET = 260 - 45 - 65 - 1


def _archive_with(path: Path, names: list[str]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name in names:
            info = tarfile.TarInfo(f"pkg-1.0/vendor/llama.cpp/{name}")
            data = name.encode()
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def test_the_web_ui_sources_are_left_in_the_archive(tmp_path: Path) -> None:
    needed = ["CMakeLists.txt", "include/llama.h", "ggml/include/ggml.h", "tools/mtmd/mtmd.h"]
    ui_build = ["tools/ui/CMakeLists.txt", "tools/ui/sources.cmake", "tools/ui/ui.cpp.in"]
    npm_only = ["tools/ui/src/lib/App.svelte", "tools/ui/tests/unit/a.test.ts"]
    archive = _archive_with(tmp_path / "a.tar.gz", needed + ui_build + npm_only)
    tree = tmp_path / "tree"
    source._extract_tree(archive, "pkg-1.0/vendor/llama.cpp", tree)
    for name in needed + ui_build:
        assert (tree / name).read_text() == name
    assert not (tree / "tools/ui/src").exists() and not (tree / "tools/ui/tests").exists()


def test_every_extracted_path_of_the_pin_fits_windows_max_path(tmp_path: Path) -> None:
    archive = source.read_pin()["source_archive"]
    path = source.pinned_archive()
    with tarfile.open(path) as tar:
        prefix = archive["tree"] + "/"
        everything = [m.name[len(prefix) :] for m in tar.getmembers() if m.name.startswith(prefix)]
    assert max(map(len, everything)) > WINDOWS_PATH_BUDGET  # what the exclusion is for
    tree = tmp_path / "t"
    source._extract_tree(path, archive["tree"], tree)
    extracted = [str(p.relative_to(tree)) for p in tree.rglob("*")]
    assert max(map(len, extracted)) <= WINDOWS_PATH_BUDGET
    assert (tree / "tools/ui/CMakeLists.txt").is_file()  # the tools build configures the UI
    assert len(extracted) > 1000
