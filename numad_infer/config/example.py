"""etc/numa-infer.toml, the file the package installs as /etc/numa-infer.toml, generated from
the schema so that its comments cannot contradict the reference: every table and key in the
schema's order, each under its description (the text of numa-infer.toml(5)),
each at its default unless `SHIPPED` says otherwise, and why. Pure.

`tools/config_reference.py` writes the file; tests/test_docs.py fails when it differs from
`example_toml()`, and tests/config/test_example.py loads it with the real loader.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass

from numad_infer.config.reference import ARRAYS, KeyDoc, keys, table_of, tables

PATH = "etc/numa-infer.toml"  # in the source tree
WIDTH = 88  # a terminal's width, less an editor's line numbers

HEADER = (
    "numa-infer configuration. Every key is optional except model.path (or, for several",
    "models, each [[models]] table's name and path: see [[models]] below).",
    "Reference: numa-infer.toml(5) and README.md. Validate with `numa-infer check`.",
    "Each key's comment is its text in that reference, then in [brackets] its type and,",
    "where the value here is another, its default. A key commented out is at its default.",
)

# Kinds the value itself shows: naming them would only lengthen the comment.
_PLAIN_KINDS = frozenset({"bool", "string", "list of strings"})


@dataclass(frozen=True)
class Shipped:
    """Where the shipped file departs from "every key, set to its default"."""

    why: str  # for whoever changes it; the file shows only the default it replaces
    value: str | None = None  # TOML; None: the default
    commented: bool = False  # written as a comment: the key is not set


SHIPPED: dict[str, Shipped] = {
    "model.path": Shipped(
        "required, so the schema has no default: the path README.md's install steps copy the model to",
        '"/var/lib/numa-infer/models/model.gguf"'),
    "model.name": Shipped(
        'clients send one id, "model", whichever file is loaded; the default, the file\'s path, names a '
        "directory layout and changes when the file moves",
        '"model"'),
    "placement.nodes": Shipped(
        "with [[models]] each model has its own (models[].nodes) and a set placement.nodes is refused: left "
        "unset, uncommenting the [[models]] example is all it takes to switch",
        commented=True),
    "placement.instances_per_node": Shipped(
        "with [[models]] each model has its own (models[].instances_per_node) and a set one is refused: left "
        "unset for the same reason as placement.nodes",
        commented=True),
    "server.parallel": Shipped(
        "llama-server is the shipped engine for its slots (more tokens/s under concurrency, bench/README.md); "
        "with one slot the front door would queue every request behind the one in progress",
        "4"),
    "server.python": Shipped(
        "llama-cpp-python's key: set while server.engine is llama-server it is refused (engines/keys.py), so "
        "it is shown for whoever switches",
        commented=True),
    "server.user": Shipped(
        "only the process backend run as root reads it (systemd units get a DynamicUser); unset, it stays the "
        "package's own user, and no copied line pins the servers to a shared one such as nobody (an earlier "
        "file did)",
        commented=True),
}


def _comment(text: str, facts: str = "") -> list[str]:
    # Descriptions carry markdown code spans; a comment is plain text.
    plain = text.replace("`", "")
    if facts:
        # One word to the wrapper (NUL for its spaces): "[int" and "1..64]" on two lines
        # would read as two things.
        plain += " [" + facts.replace("`", "").replace(" ", "\0") + "]"
    wrapped = textwrap.wrap(plain, WIDTH - 2, break_long_words=False, break_on_hyphens=False)
    return ["# " + line.replace("\0", " ") for line in wrapped]


def _key(doc: KeyDoc) -> list[str]:
    shipped = SHIPPED.get(doc.key)
    value = shipped.value if shipped is not None and shipped.value is not None else doc.default
    if value is None:
        raise ValueError(f"{doc.key} is required: SHIPPED must give it a value")
    facts = [] if doc.kind in _PLAIN_KINDS else [doc.kind]
    if doc.default is None:
        facts.append("required")
    elif value != doc.default:
        facts.append(f"default {doc.default}")
    commented = shipped is not None and shipped.commented
    return [*_comment(doc.meaning, "; ".join(facts)), f"{'# ' if commented else ''}{doc.name} = {value}"]


def _facts(doc: KeyDoc) -> str:
    facts = [] if doc.kind in _PLAIN_KINDS else [doc.kind]
    facts.append("required" if doc.default is None else f"default {doc.default}")
    return "; ".join(facts)


def _array(table: str, about: str, docs: list[KeyDoc]) -> list[str]:
    """An array of tables (`[[models]]`), all commented out: the file's active form is the
    single `[model]`. Each key's description as a paragraph, then the worked example, which
    uncommented (and `[model]` removed) is a valid file."""
    array = ARRAYS[table]
    lines = ["", *_comment(f"[[{table}]]: {about}. {array.file_intro}")]
    for doc in docs:
        if doc.section == table:
            lines += ["#", *_comment(f"{doc.key}: {doc.meaning}", _facts(doc))]
    lines += ["#", *_comment(array.about + ":"), "#"]
    return lines + [f"# {line}".rstrip() for line in array.example.splitlines()]


def example_toml() -> str:
    """The whole file."""
    lines = ["# " + line for line in HEADER]
    docs = keys()
    for table, about in tables():
        if table_of(table)[1]:
            lines += _array(table, about, docs)
            continue
        lines += ["", *_comment(about), f"[{table}]"]
        for doc in docs:
            if doc.section == table:
                lines += ["", *_key(doc)]
    return "\n".join(lines) + "\n"
