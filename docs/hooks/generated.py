"""MkDocs hooks: the pages built from the code, so that they cannot drift from it.

- `<!-- config-reference -->` (docs/config.md) becomes one table per config section, read
  from the pydantic schema in `scaletrain.config`: every key, its default, the values it
  allows and its one-line description, the same descriptions `scaletrain explain --all`
  prints (`describe_fields`).
- `<!-- public-api -->` (docs/api.md) becomes one mkdocstrings block (`::: module.Name`)
  for every name `scaletrain/__init__.py` exports, found where it is defined, so that a
  module moving does not break the page.

Nothing here is written by hand about a field: a key added to the schema appears on the
next build, and a key without a description fails the build (`mkdocs build --strict`).
"""

from __future__ import annotations

import logging
import sys
import typing
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.hooks.generated")

CONFIG_MARKER = "<!-- config-reference -->"
API_MARKER = "<!-- public-api -->"


def on_config(config, **kwargs):
    # The package is installed into .venv editable; a plain checkout finds it under src/.
    src = Path(config["config_file_path"]).parent / "src"
    if src.is_dir() and str(src) not in sys.path:
        sys.path.insert(0, str(src))
    return config


def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    if CONFIG_MARKER in markdown:
        markdown = markdown.replace(CONFIG_MARKER, config_reference())
    if API_MARKER in markdown:
        markdown = markdown.replace(API_MARKER, public_api())
    return markdown


# --------------------------------------------------------------------------- config reference


def config_reference() -> str:
    from pydantic import BaseModel

    from scaletrain.config import Config, describe_fields

    described = {key: doc for key, _value, doc in describe_fields(Config())}
    top: list[tuple[str, Any]] = []
    parts: list[str] = []
    for section_name, section_field in Config.model_fields.items():
        schema = section_field.annotation
        if not (isinstance(schema, type) and issubclass(schema, BaseModel)):
            top.append((section_name, section_field))
            continue
        rows = [
            _row(key, field, described.get(f"{section_name}.{key}", ""), f"{section_name}.{key}")
            for key, field in schema.model_fields.items()
        ]
        parts.append(f"## `[{section_name}]`\n\n{_table(rows)}\n")
    if top:
        rows = [_row(key, field, described.get(key, ""), key) for key, field in top]
        parts.insert(0, f"## Top level\n\n{_table(rows)}\n")
    return "\n".join(parts)


def _row(key: str, field, doc: str, dotted: str) -> list[str]:
    doc = " ".join((doc or field.description or "").split())
    if not doc:
        log.warning("config key %s has no description (a docstring under its field)", dotted)
    return [f"`{key}`", f"`{_toml(field.default)}`", _allowed(field, dotted), _cell(doc)]


def _table(rows: list[list[str]]) -> str:
    lines = ["| key | default | allowed | description |", "|---|---|---|---|"]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(text: str) -> str:
    """Markdown-safe table cell: pipes escaped; outside `code`, no HTML tags or emphasis."""
    pieces = text.split("`")
    for i in range(0, len(pieces), 2):  # even pieces lie outside code spans
        pieces[i] = (
            pieces[i].replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")
        ).replace("*", "\\*")
    return "`".join(pieces).replace("|", "\\|")


def _toml(value: Any) -> str:
    """A default as it would be written in a TOML file."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return f'"{value}"'
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    return repr(value)


def _allowed(field, dotted: str) -> str:
    """The values the schema accepts: a Literal's choices, numeric bounds, else the type;
    a string field with a validator of its own is asked, through the error a user would see."""
    annotation = field.annotation
    if typing.get_origin(annotation) is typing.Literal:
        return ", ".join(f"`{_toml(v)}`" for v in typing.get_args(annotation))
    if annotation is bool:
        return "`true`, `false`"
    bounds = _bounds(field.metadata)
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        meta = [m for a in args[:1] for m in getattr(a, "__metadata__", ())]
        inner = _bounds(meta[0].metadata) if meta else ""
        return _cell(f"{len(args)} numbers" + (f", each {inner}" if inner else ""))
    if annotation in (int, float):
        kind = "integer" if annotation is int else "number"
        return _cell(f"{kind} {bounds}".strip())
    if annotation is str:
        pattern = next((m.pattern for m in field.metadata if getattr(m, "pattern", None)), None)
        if pattern:
            return _cell(f"text matching `{pattern}`")
        choices = _asked(dotted)
        return _cell(choices or "text")
    origin = typing.get_origin(annotation)
    if origin is dict:
        return "a table"
    if origin is list:
        (item,) = typing.get_args(annotation) or (Any,)
        return f"a list of {getattr(item, '__name__', 'values')}s"
    return _cell(str(annotation))


def _bounds(metadata) -> str:
    """annotated_types' bounds as `0 <= x < 1`, `>= 0` or `<= 64`."""
    low = high = None
    for m in metadata:
        for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
            if hasattr(m, attr):
                if attr in ("ge", "gt"):
                    low = (op, getattr(m, attr))
                else:
                    high = (op, getattr(m, attr))
    if low and high:
        flipped = {">=": "<=", ">": "<"}[low[0]]
        return f"{low[1]} {flipped} x {high[0]} {high[1]}"
    bound = low or high
    return f"{bound[0]} {bound[1]}" if bound else ""


def _asked(dotted: str) -> str:
    """What a string field with its own validator allows, from the message a bad value gets."""
    from scaletrain.config import ConfigError, apply_overrides, validate_config

    try:
        validate_config(apply_overrides({}, [f'{dotted}="?"']))
    except ConfigError as e:
        message = str(e)
        marker = "allowed: "
        if marker in message:
            return message.split(marker, 1)[1].rstrip(")")
    return ""


# --------------------------------------------------------------------------- public API


def public_api() -> str:
    import scaletrain

    blocks = []
    names = sorted(scaletrain.__all__, key=lambda n: (n != "train", n))  # the entry point first
    for name in names:
        obj = getattr(scaletrain, name)
        where = f"{obj.__module__}.{obj.__qualname__}"
        blocks.append(f"## `scaletrain.{name}`\n\n::: {where}\n")
    return "\n".join(blocks)
