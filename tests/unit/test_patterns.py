"""Names and ids are validated with ``fullmatch``: a pattern anchored with ``$`` and used
with ``match`` passes a value with a final newline (``$`` matches before it), which then
reaches a Redis key, an HTTP header or a file name. The scans read product code as source
(every ``re`` call with a literal pattern, and every ``.match`` of a compiled pattern,
followed by its name across modules); the validators are then tried with such values."""

from __future__ import annotations

import ast
import functools
import re
from pathlib import Path

import pytest

from claw_tasks.durations import duration
from claw_tasks.format.names import check_namespace
from claw_tasks.store.keyscan import parse_key
from claw_tasks.store.snapshot_format import SnapshotError, check_name
from orchestrator.gateway.requests import CALL_ID, NUMBER, TAG_NAME, TRAJECTORY, UID
from tests.support.paths import ROOT

PACKAGES = ("claw_tasks", "orchestrator")
RE_CALLS = {"compile", "match", "search", "fullmatch"}


@functools.cache
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), str(path))


def _dollar_anchored(pattern: str | bytes) -> bool:
    text = pattern.decode("latin-1") if isinstance(pattern, bytes) else pattern
    stripped = text.rstrip(")")
    return stripped.endswith("$") and not stripped.endswith("\\$")


def _anchored_patterns(path: Path, root: Path = ROOT) -> list[str]:
    found = []
    for node in ast.walk(_tree(path)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr not in RE_CALLS or not isinstance(node.func.value, ast.Name):
            continue
        if node.func.value.id != "re" or not node.args:
            continue
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str | bytes):
            if _dollar_anchored(first.value):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {first.value!r}")
        elif isinstance(first, ast.JoinedStr):  # an f-string: its literal tail
            tail = first.values[-1]
            if isinstance(tail, ast.Constant) and _dollar_anchored(str(tail.value)):
                found.append(f"{path.relative_to(root)}:{node.lineno}: f-string ending '$'")
    return found


def _compiled_names(paths: list[Path]) -> set[str]:
    """Names bound to ``re.compile(...)`` anywhere in ``paths`` (module constants, class
    attributes), so their use can be followed into other modules."""
    names = set()
    for path in paths:
        for node in ast.walk(_tree(path)):
            if not (isinstance(node, ast.Assign | ast.AnnAssign) and node.value is not None):
                continue
            v = node.value
            if not (isinstance(v, ast.Call) and isinstance(v.func, ast.Attribute)):
                continue
            if v.func.attr != "compile" or getattr(v.func.value, "id", None) != "re":
                continue
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            for t in targets:
                name = t.id if isinstance(t, ast.Name) else getattr(t, "attr", None)
                if name:
                    names.add(name)
    return names


def _prefix_matches(path: Path, compiled: set[str], root: Path = ROOT) -> list[str]:
    """``re.match(...)`` and ``P.match(...)`` of a compiled pattern ``P``: a match of a
    prefix, whatever the pattern's anchors (a stored pattern is followed by its name), and
    ``^...$`` strings kept for a later ``re`` call."""
    found = []
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant):
            v = node.value.value
            if isinstance(v, str | bytes) and v[:1] in ("^", b"^") and _dollar_anchored(v):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {v!r} kept for re")
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        if node.func.attr != "match":
            continue
        owner = node.func.value
        name = owner.id if isinstance(owner, ast.Name) else getattr(owner, "attr", None)
        if name == "re" or name in compiled:
            found.append(f"{path.relative_to(root)}:{node.lineno}: {name}.match")
    return found


def _product_files() -> list[Path]:
    return [p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))]


def test_no_compiled_pattern_is_used_with_match() -> None:
    paths = _product_files()
    compiled = _compiled_names(paths)
    assert {"UID", "TRAJECTORY", "NAMESPACE"} <= compiled  # the scan sees the validators
    offenders = [hit for p in paths for hit in _prefix_matches(p, compiled)]
    assert offenders == [], "validate with pattern.fullmatch(...):\n" + "\n".join(offenders)


def test_the_scan_follows_a_stored_pattern(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text('import re\nNAME = re.compile(r"[a-z]+")\nRAW = r"^x+$"\n')
    (tmp_path / "b.py").write_text(
        "import re\n"
        "from a import NAME\n"
        "import a\n"
        "ok = NAME.fullmatch(v) and a.NAME.fullmatch(v)\n"
        "bad = NAME.match(v) or a.NAME.match(v) or re.match(a.RAW, v)\n"
        "fine = query.match(expression)\n"  # not a pattern: another object's method
    )
    paths = sorted(tmp_path.glob("*.py"))
    compiled = _compiled_names(paths)
    assert compiled == {"NAME"}
    hits = [h for p in paths for h in _prefix_matches(p, compiled, tmp_path)]
    assert len(hits) == 4, hits


def test_no_product_pattern_is_anchored_with_a_dollar() -> None:
    offenders = [
        hit
        for package in PACKAGES
        for path in sorted((ROOT / package).rglob("*.py"))
        for hit in _anchored_patterns(path)
    ]
    assert offenders == [], (
        "validate names and ids with pattern.fullmatch(...) (no '^...$': '$' also matches "
        "before a final newline):\n" + "\n".join(offenders)
    )


def test_the_scan_finds_a_dollar_anchored_pattern(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import re\n"
        'A = re.compile(r"^[a-z]+$")\n'
        'B = re.compile(rb"^x(y)$")\n'
        'C = re.match(r"^(a|b)$", "a")\n'
        'D = re.compile(r"[a-z]+\\$")\n'  # an escaped dollar: a literal '$'
    )
    assert len(_anchored_patterns(probe, tmp_path)) == 3


@pytest.mark.parametrize("value", ["abc\n", "abc\r\n", "\nabc", "a b", "", "abc\x00"])
def test_validators_refuse_a_final_newline_and_other_separators(value: str) -> None:
    for pattern in (UID, TRAJECTORY, TAG_NAME):
        assert pattern.fullmatch(value) is None, (pattern.pattern, value)
    with pytest.raises(SnapshotError):
        check_name(value)
    with pytest.raises(ValueError):
        check_namespace(value)
    assert parse_key(f"claw:{{{value}}}:config".encode()) is None


def test_validators_take_their_names() -> None:
    for good in ("abc", "A-1.b_c", "x" * 128):
        check_name(good)
        check_namespace(good)
        assert UID.fullmatch(good) and TRAJECTORY.fullmatch(good)
    assert TRAJECTORY.fullmatch("abc~0") and TRAJECTORY.fullmatch("abc~63")
    for choice in ("abc~07", "abc~", "abc~12345", "abc~1\n"):  # not how a split names one
        assert TRAJECTORY.fullmatch(choice) is None, choice
    assert CALL_ID.fullmatch("0123456789abcdef") and not CALL_ID.fullmatch("0123456789abcdef\n")
    assert NUMBER.fullmatch("-1.5") and not NUMBER.fullmatch("1\n")
    assert duration("30s") == 30 and duration("30s\n") is None
    assert parse_key(b"claw:{abc:3}:m:id:0") is not None


SECRET = re.compile(r"\b(csrf|password|passwd|secret|api_key|token)\b", re.I)
AUTH_CODE = ("orchestrator/web", "orchestrator/gateway", "orchestrator/cli/exporter.py")


def _secret_comparisons(path: Path, root: Path = ROOT) -> list[str]:
    """``==`` / ``!=`` whose operands name a secret (a token, password, CSRF value): such a
    comparison takes longer the more leading characters match."""
    text = path.read_text()
    found = []
    for node in ast.walk(ast.parse(text, str(path))):
        if isinstance(node, ast.Compare) and any(
            isinstance(op, ast.Eq | ast.NotEq) for op in node.ops
        ):
            operands = [node.left, *node.comparators]
            if any(isinstance(o, ast.Constant) and o.value is None for o in operands):
                continue  # "is it given at all" is not a comparison of its value
            src = ast.get_source_segment(text, node) or ""
            if SECRET.search(src):
                found.append(f"{path.relative_to(root)}:{node.lineno}: {src}")
    return found


def test_secrets_are_compared_in_constant_time() -> None:
    paths = sorted(
        p
        for part in AUTH_CODE
        for p in ((ROOT / part).rglob("*.py") if (ROOT / part).is_dir() else [ROOT / part])
    )
    offenders = [hit for p in paths for hit in _secret_comparisons(p)]
    assert offenders == [], "compare secrets with hmac.compare_digest (as bytes):\n" + "\n".join(
        offenders
    )


def test_the_secret_scan_finds_an_equality(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "def f(form, session, token, expected):\n"
        '    if form.get("csrf") != session.csrf:\n'
        "        return token == expected\n"
        "    return token is None or len(tokens) == 3\n"
    )
    assert len(_secret_comparisons(probe, tmp_path)) == 2
