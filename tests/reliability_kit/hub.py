"""A hostile hub: ``resolve("crab/m")`` against a Hub look-alike whose answers are changed.

Each case changes one to three things the endpoint says: the repository listing (its status,
a body that is no listing, file names that are paths, thousands of entries, pages that go on
for ever, are empty, or continue on another host) and the answers about the file, HEAD and
GET alike or one of them (the ETag, X-Linked-Etag, X-Repo-Commit and X-Linked-Size headers
set to paths, empty, huge or missing; error statuses with hostile headers; redirects in a loop,
to another host or to a file:// URL; a body that is garbage, cut, empty or longer than
declared, and a Content-Length that lies). Then the resolved file, if any, is loaded and
completed with.

What must hold: ``resolve`` returns a file inside the case's cache or raises a LlamaError
(HubError); loading it gives a model or a LlamaError; nothing is written outside the case's
cache (a sentinel directory, which the hostile paths point into, stays empty); a second
endpoint, to which the redirects and "next" links point, never sees the token; every case
ends within its time limit. A large Retry-After is left out: huggingface_hub sleeps for it
(SECURITY.md).
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

TOKEN = "hf_fuzzTOKEN789"
# Paths in answers: {sentinel} and {other} are filled in by the child (its sentinel directory
# and the second endpoint); a climbing path leaves blobs/, the repository's cache and the
# case's cache, to reach the sentinel beside it.
PATHS = ["{sentinel}/written", "../../../sentinel/written", "../../../../sentinel/deeper/x",
         "W/\"{sentinel}/weak\"", "..", ".", "", "a/b", "a\\b", "x" * 5000, "é" * 64,
         "{sentinel}"]  # fmt: skip
PLAIN = ["e" * 64, "0123456789abcdef" * 2 + "01234567", "abc-5"]
SIZES = ["-1", "0", "1", "99999999999999999999", "x", "1e3", ""]
NAMES = ["../written.gguf", "/{sentinel}/abs.gguf", "a/../../b.gguf", "a\\b.gguf", "a//b.gguf",
         "./m.gguf", "m.gguf/", "\u0000.gguf", "x" * 5000 + ".gguf", "mmproj-m.gguf",
         "m-00001-of-00002.gguf", "m.GGUF", 7, None, ["m.gguf"]]  # fmt: skip
BODIES = ["<html>no</html>", "{}", "null", "[1, 2]", '"m.gguf"', "[" * 100_000, "",
          '[{"type": "file"}]', '[{"path": "m.gguf"}]',
          '[{"type": "directory", "path": "m.gguf"}]']  # fmt: skip
STATUSES = [401, 403, 404, 410, 500, 503, 418, 204, 304]


# -- generation (parent) -----------------------------------------------------------------------


def generate(count: int, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    cases = []
    for i in range(count):
        changes = [_change(rng) for _ in range(rng.choice((1, 1, 2, 3)))]
        cases.append({"id": f"hub-{seed}-{i}", "changes": changes})
    return cases


def _change(rng: random.Random) -> dict[str, Any]:
    kind = rng.choices(["listing", "pages", "header", "status", "redirect", "body"],
                       weights=[3, 2, 5, 2, 2, 3])[0]  # fmt: skip
    change: dict[str, Any] = {"kind": kind, "on": rng.choice(["HEAD", "GET", "both"])}
    if kind == "listing":
        what = rng.choice(["names", "body", "status", "many"])
        change["what"] = what
        if what == "names":
            change["names"] = rng.sample(NAMES, rng.randint(1, 3)) + ["m.gguf"] * rng.randint(0, 1)
        elif what == "body":
            change["body"] = rng.choice(BODIES)
        elif what == "status":
            change["status"] = rng.choice(STATUSES)
        else:
            change["count"] = rng.choice([10, 3000, 100_001])
    elif kind == "pages":
        change["pages"] = rng.choice(["endless", "empty", "other host", "relative", "self"])
    elif kind == "header":
        change["header"] = rng.choice(["ETag", "X-Linked-Etag", "X-Repo-Commit", "X-Linked-Size"])
        pool = SIZES if change["header"] == "X-Linked-Size" else PATHS + PLAIN
        change["value"] = rng.choice([*pool, None])  # None: the header left out
        change["quoted"] = rng.random() < 0.5
    elif kind == "status":
        change["status"] = rng.choice([*STATUSES, 429])
        change["commit"] = rng.choice([*PATHS, None])
    elif kind == "redirect":
        change["to"] = rng.choice(["other host", "loop", "file", "relative", "nowhere"])
    else:
        change["body"] = rng.choice(["garbage", "cut", "empty", "longer", "short length",
                                     "long length"])  # fmt: skip
        change["keep"] = rng.random()
    return change


# -- the child's side ---------------------------------------------------------------------------


def setup(config: dict[str, Any], slot: int) -> dict[str, Any]:
    """The hostile endpoint and a second one (where redirects and "next" links point), both
    serving the tiny model, and a work folder for the caches and the sentinel."""
    from hub_server import HubServer, Repo

    model = Path(config["model"]).read_bytes()
    servers = [HubServer({"crab/m": Repo({"main": {"m.gguf": model}})}) for _ in range(2)]
    work = Path(config["workdir"]) / f"slot{slot}"
    return {"hub": servers[0], "other": servers[1], "work": work, "model": model, "count": 0}


def run_case(case: dict[str, Any], state: dict[str, Any]) -> tuple[str, str]:
    """Resolve and load through the changed endpoint; a LlamaError raised out of here is the
    expected refusal, once the invariants (nothing outside the cache, no token elsewhere) are
    checked."""
    from llamacrab import HubOptions, Llama, LlamaError, resolve

    hub, other, work = state["hub"], state["other"], state["work"]
    state["count"] += 1
    cache, sentinel = work / f"cache{state['count']}", work / "sentinel"
    shutil.rmtree(work, ignore_errors=True)
    sentinel.mkdir(parents=True)
    other.authorizations.clear()
    fill = {"sentinel": str(sentinel), "other": other.endpoint, "hub": hub.endpoint}
    hub.tamper = Tamper(case["changes"], fill, state["model"])
    refusal: LlamaError | None = None
    detail = ""
    try:
        path = resolve("crab/m", HubOptions(endpoint=hub.endpoint, cache_dir=cache, token=TOKEN))
        real = path.path.resolve()
        if cache.resolve() not in real.parents:
            raise RuntimeError(f"resolve gave {real}, outside the cache {cache}")
        detail = f"resolved {real.stat().st_size} bytes"
        with Llama(path.path, n_ctx=64, n_threads=1) as llm:
            tokens = llm.create_completion("the cat", max_tokens=2).usage.completion_tokens
        detail += f"; {tokens} tokens"
    except LlamaError as error:
        refusal = error
    finally:
        hub.tamper = None
    outside = [str(p.relative_to(work)) for p in sentinel.rglob("*")]
    outside += [p.name for p in work.iterdir() if p.name not in ("sentinel", cache.name)]
    if outside:
        raise RuntimeError(f"written outside the cache: {outside[:5]}")
    if any(TOKEN in authorization for authorization in other.authorizations):
        raise RuntimeError("the other host was sent the token")
    if refusal is not None:
        raise refusal
    return "ok", detail


class Tamper:
    """The hub server's tamper hook for one case: each change applied in turn to an answer."""

    def __init__(self, changes: list[dict[str, Any]], fill: dict[str, str], model: bytes):
        self.changes, self.fill, self.model = changes, fill, model
        self.pages = 0
        self.many: bytes | None = None

    def __call__(
        self, method: str, path: str, status: int, body: bytes, headers: dict[str, str]
    ) -> tuple[int, bytes, dict[str, str]]:
        answer = (status, body, dict(headers))
        for change in self.changes:
            if "/tree/" in path and change["kind"] in ("listing", "pages"):
                answer = self._listing(change, path, answer)
            elif "/resolve/" in path and change["on"] in (method, "both"):
                answer = self._file(change, method, path, answer)
        return answer

    def _text(self, value: str) -> str:
        for name, filled in self.fill.items():
            value = value.replace(f"{{{name}}}", filled)
        return value

    def _listing(self, change: dict[str, Any], path: str, answer: Any) -> Any:
        headers = {**answer[2], "Content-Type": "application/json"}
        if change["kind"] == "pages":
            return self._page(change["pages"], path, headers)
        what = change["what"]
        if what == "status":
            return change["status"], b"{}", headers
        if what == "body":
            return 200, change["body"].encode(), headers
        if what == "many":  # made once: a case may ask for a thousand pages of it
            if self.many is None:
                names = [f"f{i}.bin" for i in range(change["count"])] + ["m.gguf"]
                self.many = json.dumps([_entry(n) for n in names]).encode()
            return 200, self.many, headers
        names = [self._text(n) if isinstance(n, str) else n for n in change["names"]]
        return 200, json.dumps([_entry(n) for n in names]).encode(), headers

    def _page(self, kind: str, path: str, headers: dict[str, str]) -> Any:
        self.pages += 1
        tree = "/api/models/crab/m/tree/main"
        entries, following = [_entry("m.gguf")], None
        if kind == "endless":  # (absolute links: a relative one is "relative")
            following = f"{self.fill['hub']}{tree}?page={self.pages}"
        elif kind == "empty":
            entries, following = [], f"{self.fill['hub']}{tree}?page={self.pages}"
        elif kind == "other host":
            following = f"{self.fill['other']}{tree}?page=2"
        elif kind == "relative" and "cursor" not in path:
            entries, following = [_entry("README.md")], "?cursor=2"
        elif kind == "self":
            following = path
        if following is not None:
            headers["Link"] = f'<{following}>; rel="next"'
        return 200, json.dumps(entries).encode(), headers

    def _file(self, change: dict[str, Any], method: str, path: str, answer: Any) -> Any:
        status, body, headers = answer
        kind = change["kind"]
        if kind == "header":
            headers.pop(change["header"], None)
            if change["value"] is not None:
                value = self._text(change["value"])
                headers[change["header"]] = f'"{value}"' if change["quoted"] else value
        elif kind == "status":
            status, body = change["status"], b"{}"
            if status == 404:
                headers["X-Error-Code"] = "EntryNotFound"
            if status == 429:
                headers["Retry-After"] = "0"
            if change["commit"] is not None:
                headers["X-Repo-Commit"] = self._text(change["commit"])
        elif kind == "redirect":
            status, body = 302, b""
            headers["Location"] = {
                "other host": f"{self.fill['other']}/crab/m/resolve/main/m.gguf",
                "loop": path,
                "file": f"file://{self.fill['sentinel']}/written",
                "relative": path if "r=1" in path else f"{path}?r=1",
                "nowhere": "http://127.0.0.1:1/m.gguf",
            }[change["to"]]
        elif kind == "body":
            body, headers = self._body(change, body, headers)
        return status, body, headers

    def _body(self, change: dict[str, Any], body: bytes, headers: dict[str, str]) -> Any:
        what, cut = change["body"], int(change["keep"] * len(self.model))
        if what == "garbage":
            body = b"GGUF" + bytes(range(256)) * (len(self.model) // 256)
        elif what == "cut":
            body = self.model[:cut]
        elif what == "empty":
            body = b""
        elif what == "longer":
            body = self.model + b"\0" * 4096
        elif what == "short length":
            headers["Content-Length"] = str(cut)
        else:
            headers["Content-Length"] = str(len(body) + 1 + cut)
        return body, headers


def _entry(name: object) -> dict[str, Any]:
    return {"type": "file", "path": name, "size": 1, "oid": "0" * 40}
