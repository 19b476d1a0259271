"""The shapes of SQL Citus refuses over a table distributed by ``event_id``, pinned without
Citus: every statement the proxy sends over the claim table is parsed by PostgreSQL's own
parser (pglast, libpg_query) and its tree walked, subqueries included.

1. A locking SELECT (FOR UPDATE/SHARE) names one row: ``scope = …`` AND ``event_id = …`` at the
   top of its own WHERE. Citus: "could not run distributed query with FOR UPDATE/SHARE".
2. No non-IMMUTABLE call inside CASE or COALESCE in an UPDATE or DELETE, time arithmetic
   (timestamptz + interval, STABLE) included. Citus: "non-IMMUTABLE functions are not allowed
   in CASE or COALESCE statements" (seen on Citus 13.2 for both).
3. An INSERT supplies both key columns; a claim-path statement filters on both (the operators'
   commands may take ``event_id = ANY(…)``).
4. The INSERT's ON CONFLICT is (scope, event_id) DO NOTHING; only an ordered route's object row
   (``Queries.hold_object``) is locked by DO UPDATE, on the same whole key (not yet run on
   Citus).
5. No session-level advisory lock: a transaction's own runs on the coordinator.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Iterator

import pglast
import pytest
from pglast import ast, enums

from proxy.database import inbox_sql, slots, sql

_TABLE = ("dedup", "claims")
_QUERIES = sql.for_table(".".join(_TABLE))
# Not statements: the table's name, spelled and quoted; and the heads of the claim and of the
# duplicate's check, whole statements only as the builders finish them (sampled in _BUILT).
_NOT_STATEMENTS = {"table", "quoted", "insert", "duplicate_of", "kept_duplicate_of"}
_DIGEST = b"\1" * 32
_BUILT = {
    "claim": _QUERIES.claim(sql.begin(1, 1), "s", "e'1\\", "t", _DIGEST),
    "claim(commit)": _QUERIES.claim(sql.begin(1, 1), "s", "e", None, _DIGEST, commit=True),
    "commit_answer": _QUERIES.commit_answer("s", "e", 200, [("a", "b")], b"x"),
    "duplicate": _QUERIES.duplicate("s", "e", _DIGEST),
    "duplicate(inbox)": _QUERIES.duplicate("s", "e", _DIGEST, inbox=True),
    # The upgrade window: both forms of the ID.
    "claim(also)": _QUERIES.claim(sql.begin(1, 1), "s", "e~1", "t", _DIGEST, also="e"),
    "commit_answer(also)": _QUERIES.commit_answer("s", "e~1", 200, [], b"x", also="e"),
    "duplicate(legacy)": _QUERIES.duplicate("s", "e~1", _DIGEST, legacy="e"),
    "duplicate(legacy, inbox)": _QUERIES.duplicate("s", "e~1", _DIGEST, inbox=True, legacy="e"),
    # order: the object's row, locked after the claim's; its version at COMMIT; superseded.
    "hold_object": _QUERIES.hold_object(sql.lock_timeout(1), "s", "o'1", "12.5", behind=True),
    "accepted": _QUERIES.accepted("s", "o", "12.5") + "COMMIT",
    "superseded": _QUERIES.superseded("s", "e"),
}
# The claim path works on one row, as does any statement named "…_one"; the operators' commands
# on the rows they name by key.
_ONE_ROW = {
    "claim",
    "commit_answer",
    "answer",
    "duplicate",
    "queue",
    "delivered",
    "failed",
    "show",
    "take",
}
_NAMED_ROWS = {"forget", "redeliver", "discard"}
_KEYS = ("scope", "event_id")
_NOT_IMMUTABLE = {
    "now",
    "clock_timestamp",
    "statement_timestamp",
    "transaction_timestamp",
    "timeofday",
    "random",
    "nextval",
    "currval",
    "setval",
}
_SESSION_LOCKS = {
    "pg_advisory_lock",
    "pg_advisory_lock_shared",
    "pg_try_advisory_lock",
    "pg_try_advisory_lock_shared",
}


def _statements() -> dict[str, str]:
    """Every statement by its test id: each SQL field of ``Queries``, each sampled builder,
    each property of ``Statements``: a field or property added later is checked unasked."""
    inbox = inbox_sql.Statements(_QUERIES.quoted)
    fields = [f.name for f in dataclasses.fields(sql.Queries) if f.name not in _NOT_STATEMENTS]
    properties = [n for n, m in vars(inbox_sql.Statements).items() if isinstance(m, property)]
    texts = {name: getattr(_QUERIES, name) for name in fields}
    steps = {
        f"{name}[{i}]": step
        for name, value in texts.items()
        if isinstance(value, tuple)
        for i, step in enumerate(value)
    }
    return (
        {f"Queries.{name}": text for name, text in texts.items() if isinstance(text, str)}
        | {f"Queries.{name}": text for name, text in steps.items()}
        | {f"Queries.{name}": text for name, text in _BUILT.items()}
        | {f"Statements.{name}": getattr(inbox, name) for name in properties}
    )


def _walk(value: object) -> Iterator[ast.Node]:
    """Every node under ``value``, itself included, in any attribute and list."""
    if isinstance(value, ast.Node):
        yield value
        for attribute in getattr(type(value), "__slots__", ()):
            yield from _walk(getattr(value, attribute, None))
    elif isinstance(value, tuple | list):
        for item in value:
            yield from _walk(item)


def _name(node: ast.FuncCall | ast.ColumnRef | ast.A_Expr) -> str:
    """A function's, a column's or an operator's last name ("now", "event_id", "=")."""
    if isinstance(node, ast.ColumnRef):
        parts = node.fields
    else:
        parts = node.name if isinstance(node, ast.A_Expr) else node.funcname
    last = (parts or [None])[-1]
    return (last.sval or "") if isinstance(last, ast.String) else "*"


def _conjuncts(node: object) -> Iterator[object]:
    if isinstance(node, ast.BoolExpr) and node.boolop == enums.BoolExprType.AND_EXPR:
        for arg in node.args or ():
            yield from _conjuncts(arg)
    else:
        yield node


def _is_value(node: object) -> bool:
    while isinstance(node, ast.TypeCast):
        node = node.arg
    return isinstance(node, ast.ParamRef | ast.A_Const)


def _keyed(where: object, *, named_rows: bool = False) -> bool:
    """Whether ``where`` is ``scope = v AND event_id = v AND …`` at its top (v a parameter or
    constant); with ``named_rows``, ``event_id = ANY(v)`` too."""
    kind = enums.A_Expr_Kind
    kinds = {kind.AEXPR_OP: set(_KEYS), kind.AEXPR_OP_ANY: {"event_id"} if named_rows else set()}
    found: set[str] = set()
    for c in _conjuncts(where):
        if isinstance(c, ast.A_Expr) and c.kind in kinds and _name(c) == "=":
            for column, value in ((c.lexpr, c.rexpr), (c.rexpr, c.lexpr)):
                if isinstance(column, ast.ColumnRef) and _is_value(value):
                    found |= {_name(column)} & kinds[c.kind]
    return found == set(_KEYS)


def _over(node: object, table: tuple[str | None, str]) -> bool:
    """Whether the statement ``node`` itself (not a subquery of it) works on ``table``."""
    if isinstance(node, ast.InsertStmt | ast.UpdateStmt | ast.DeleteStmt):
        relations: list[object] = [node.relation]
    elif isinstance(node, ast.SelectStmt):
        relations = list(node.fromClause or ())
    else:
        return False
    return any(
        isinstance(r, ast.RangeVar) and (r.schemaname, r.relname) == table for r in relations
    )


def _not_immutable(node: ast.Node) -> list[str]:
    """Rule 2: the non-IMMUTABLE calls inside CASE or COALESCE in an UPDATE or DELETE."""
    if not isinstance(node, ast.UpdateStmt | ast.DeleteStmt):
        return []
    calls = set()
    for branch in _walk(node):
        if isinstance(branch, ast.CaseExpr | ast.CoalesceExpr):
            for call in _walk(branch):
                if isinstance(call, ast.FuncCall) and _name(call) in _NOT_IMMUTABLE:
                    calls.add(f"{_name(call)}() in {type(branch).__name__}")
                elif isinstance(call, ast.SQLValueFunction):
                    calls.add(f"{call.op!r} in {type(branch).__name__}")
                elif (
                    isinstance(call, ast.A_Expr)
                    and _name(call) in {"+", "-"}
                    and (_timely(call.lexpr) or _timely(call.rexpr))
                ):
                    calls.add(f"time arithmetic in {type(branch).__name__}")
    return [f"rule 2: non-IMMUTABLE {call} in an UPDATE/DELETE" for call in sorted(calls)]


def _timely(node: object) -> bool:
    """Whether ``node`` is a time or an interval by its spelling: a cast to one, or
    make_interval()."""
    if isinstance(node, ast.TypeCast) and node.typeName is not None:
        names = node.typeName.names or ()
        last = names[-1] if names else None
        return isinstance(last, ast.String) and last.sval in {"timestamptz", "interval"}
    return isinstance(node, ast.FuncCall) and _name(node) == "make_interval"


def _insert(node: ast.Node, table: tuple[str | None, str], upsert: bool = False) -> list[str]:
    """Rules 3 and 4 for an INSERT into ``table``."""
    if not (isinstance(node, ast.InsertStmt) and _over(node, table)):
        return []
    found = []
    if not {c.name for c in node.cols or ()} >= set(_KEYS):
        found.append("rule 3: INSERT does not supply scope and event_id")
    conflict = node.onConflictClause
    allowed = {enums.OnConflictAction.ONCONFLICT_NOTHING}
    if upsert:
        allowed.add(enums.OnConflictAction.ONCONFLICT_UPDATE)
    if conflict is None or conflict.action not in allowed:
        found.append("rule 4: INSERT without ON CONFLICT … DO NOTHING")
    elif [e.name for e in (conflict.infer and conflict.infer.indexElems) or ()] != list(_KEYS):
        found.append("rule 4: ON CONFLICT does not name exactly (scope, event_id)")
    return found


def _problems(text: str, name: str, table: tuple[str | None, str] = _TABLE) -> list[str]:
    """What ``text`` (one or more statements) does that Citus refuses, each naming its rule."""
    roots = [raw.stmt for raw in pglast.parse_sql(text)]
    found: list[str] = []
    for node in _walk(roots):
        if isinstance(node, ast.SelectStmt) and node.lockingClause and not _keyed(node.whereClause):
            found.append(
                "rule 1: FOR UPDATE/SHARE without top-level scope = … AND event_id = … in its WHERE"
            )
        if isinstance(node, ast.FuncCall) and _name(node) in _SESSION_LOCKS:
            found.append(f"rule 5: session-level {_name(node)}()")
        found += _not_immutable(node) + _insert(node, table, upsert=name == "Queries.hold_object")
    base = name.rpartition(".")[2].partition("(")[0]
    keyed = base in _ONE_ROW | _NAMED_ROWS or base.endswith("_one")
    over = [r for r in roots if keyed and _over(r, table) and not isinstance(r, ast.InsertStmt)]
    for root in over:
        if not _keyed(getattr(root, "whereClause", None), named_rows=base in _NAMED_ROWS):
            found.append("rule 3: claim-path statement not filtered on both keys")
    return found


# Statements the store never sends to a table Citus distributes (``Inbox.take`` picks
# ``take`` there instead; test_inbox_races runs both ways), or only for an ordered route, which
# is not supported there yet (guarantees.md, "Order (per object)").
_NOT_ON_CITUS = {"Statements.take_first_free", "Statements.sweep_objects"}
_ALL = {name: text for name, text in _statements().items() if name not in _NOT_ON_CITUS}


@pytest.mark.parametrize(("name", "text"), list(_ALL.items()), ids=list(_ALL))
def test_no_statement_takes_a_shape_citus_refuses(name: str, text: str) -> None:
    """Each statement over the claim table routes as Citus needs (module docstring)."""
    problems = _problems(text, name)
    assert not problems, f"{name}: " + "; ".join(problems)


def test_every_builder_is_sampled_and_every_skipped_field_exists() -> None:
    """A new statement builder on ``Queries`` must be sampled here; a skipped field renamed
    away must leave the skip list, which would otherwise hide its successor's name."""
    builders = {n for n, m in vars(sql.Queries).items() if inspect.isfunction(m) and n[0] != "_"}
    assert builders == {name.partition("(")[0] for name in _BUILT}
    assert {f.name for f in dataclasses.fields(sql.Queries)} >= _NOT_STATEMENTS


@pytest.mark.parametrize(
    ("name", "text", "rule"),
    [
        pytest.param(
            "take",
            "SELECT scope FROM t WHERE inbox_state = 'pending' LIMIT 1 FOR UPDATE SKIP LOCKED",
            "rule 1",
            id="multi-shard-skip-locked",
        ),
        pytest.param(
            "all",
            "UPDATE t SET a = 1 WHERE (scope, event_id) IN (SELECT scope, "
            "event_id FROM t WHERE scope = $1 OR event_id = $2 FOR UPDATE)",
            "rule 1",
            id="for-update-in-subquery",
        ),
        pytest.param(
            "failed",
            "UPDATE t SET a = CASE WHEN x THEN now() END WHERE scope = $1 AND event_id = $2",
            "rule 2",
            id="now-in-case",
        ),
        pytest.param(
            "failed",
            "UPDATE t SET a = CASE WHEN x THEN $3::timestamptz + "
            "make_interval(secs => $4) END WHERE scope = $1 AND event_id = $2",
            "rule 2",
            id="time-arithmetic-in-case",
        ),
        pytest.param(
            "sweep",
            "DELETE FROM t WHERE coalesce(d, current_timestamp) < $1",
            "rule 2",
            id="current-timestamp-in-coalesce",
        ),
        pytest.param(
            "show",
            "SELECT a FROM t WHERE scope = $1 AND event_id = ANY($2)",
            "rule 3",
            id="one-row-by-any",
        ),
        pytest.param(
            "claim",
            "INSERT INTO t (scope, event_id) VALUES ('s', 'e') "
            "ON CONFLICT (event_id, scope) DO NOTHING",
            "rule 4",
            id="conflict-keys",
        ),
        pytest.param("schema_lock", "SELECT pg_advisory_lock(1)", "rule 5", id="session-lock"),
        pytest.param(
            "take",
            "SELECT a FROM t WHERE scope = $1 AND event_id = $2::text AND b FOR UPDATE SKIP LOCKED",
            None,
            id="router-skip-locked-passes",
        ),
        pytest.param(
            "forget",
            "DELETE FROM t WHERE scope = $1 AND event_id = ANY($2::text[])",
            None,
            id="operator-any-passes",
        ),
        pytest.param(
            "sweep_lock", "SELECT pg_try_advisory_xact_lock(1)", None, id="transaction-lock-passes"
        ),
    ],
)
def test_the_checker_reports_each_refused_shape(name: str, text: str, rule: str | None) -> None:
    """The checker can fail: each known-bad shape (over a table ``t``) is reported under its
    rule; the accepted forms (a router FOR UPDATE, ANY for an operator, a transaction's advisory
    lock) are not."""
    problems = _problems(text, name, (None, "t"))
    if rule is None:
        assert problems == []
    else:
        assert any(p.startswith(rule) for p in problems), problems


def test_a_shared_limits_take_is_a_shape_citus_refuses_so_it_is_refused_there() -> None:
    """The places of ``upstream.concurrency: {limit: N, shared: true}`` are N rows spread over
    the shards by event_id, locked by one statement: rule 1. Not run on Citus: the start is
    refused (``slots.NOT_ON_CITUS``, tests/test_shared_limit.py)."""
    take = slots.Slots(sql.for_table(".".join(_TABLE)).quoted, 4, 1.0).take_statement
    assert any(p.startswith("rule 1") for p in _problems(take, "take_place"))


def test_the_ddl_goes_one_statement_at_a_time() -> None:
    """Citus propagates a distributed table's ALTER TABLE and CREATE INDEX only from a query of
    one statement ("cannot insert multiple commands into a prepared statement" otherwise)."""
    assert [len(pglast.parse_sql(step)) for step in _QUERIES.schema_steps] == [1] * 8
