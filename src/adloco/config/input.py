"""Configuration input read safely: YAML text of bounded size and expansion, each key once, plain values only;
``key.sub=value`` overrides never empty (and on a command line each key once); short excerpts of user input."""

from __future__ import annotations

import copy
import re
from typing import Any

import yaml

from adloco.errors import ConfigError

MAX_CONFIG_BYTES = 1 << 20  # a config of every key with long comments is a few KB; 1 MiB is plenty
# Values after YAML aliases are expanded: a config has a few hundred; a per-worker list for thousands of workers
# fits. An alias "bomb" of a few hundred bytes expands past any such bound, and is refused before anything
# walks its expansion (a validator or an error message quoting it would need gigabytes).
MAX_CONFIG_VALUES = 100_000
EXCERPT_CHARS = 60


def excerpt(value: Any, limit: int = EXCERPT_CHARS) -> str:
    """``repr(value)`` of at most about ``limit`` characters: error lines quote user input, never all of it."""
    if isinstance(value, dict | list | tuple) and count_values(value, limit) > limit:
        kind = type(value).__name__
        return f"a {kind} of more than {limit} values"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"


def count_values(data: Any, limit: int) -> int:
    """How many values ``data`` holds once aliases are expanded, counting up to just past ``limit``; a
    self-referencing structure counts as past it."""
    count = 0
    pending: list[tuple[Any, int]] = [(data, 0)]
    while pending:
        node, depth = pending.pop()
        count += 1
        if count > limit or depth > 100:
            return limit + 1
        if isinstance(node, dict):
            pending.extend((child, depth + 1) for pair in node.items() for child in pair)
        elif isinstance(node, list | tuple):
            pending.extend((child, depth + 1) for child in node)
    return count


class YAMLInputError(ValueError):
    """YAML that cannot be a config: not YAML, a tag that builds objects, a key given twice, or too large."""


class _Loader(yaml.SafeLoader):
    """YAML 1.2 booleans and numbers, every key of a mapping given once (``<<`` merges may be overridden)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in seen:
                    raise YAMLInputError(f"key '{key}' is given twice (lines {seen[key]} and {line})")
                seen[key] = line
            except TypeError:  # an unhashable key: SafeLoader says so below
                break
        return super().construct_mapping(node, deep=deep)


# Only true/false are booleans, so `merge.policy: off` stays the string 'off'.
_Loader.yaml_implicit_resolvers = {
    first: [(tag, regexp) for tag, regexp in resolvers if tag != "tag:yaml.org,2002:bool"]
    for first, resolvers in yaml.SafeLoader.yaml_implicit_resolvers.items()
}
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:bool", re.compile(r"^(?:true|True|TRUE|false|False|FALSE)$"), list("tTfF")
)
# YAML 1.2 numbers too: 2e4 and 1e-3 are floats (YAML 1.1 wants a dot and a signed exponent), so integer counts
# can be written 2e4. Checked after every other resolver, so 123 stays an int.
_Loader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:\.[0-9]+|[0-9]+(?:\.[0-9]*)?)(?:[eE][-+]?[0-9]+)?$"),
    list("-+.0123456789"),
)  # fmt: skip


def _unknown_tag(error: yaml.constructor.ConstructorError, where: str) -> str | None:
    match = re.search(r"constructor for the tag '([^']*)'", str(error.problem or ""))
    if match is None:
        return None
    tag = match.group(1).replace("tag:yaml.org,2002:", "!!")
    return f"the tag {excerpt(tag)}{where} is not allowed: a config holds plain values (numbers, text, lists, maps)"


def load_yaml(text: str) -> Any:
    """``text`` as YAML; YAMLInputError with a one-line reason (and line) for anything that is not a config."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_CONFIG_BYTES:
        raise YAMLInputError(f"it is larger than {MAX_CONFIG_BYTES // 1024} KiB")
    try:
        data = yaml.load(text, Loader=_Loader)  # noqa: S506 - a SafeLoader subclass
    except YAMLInputError:
        raise
    except yaml.constructor.ConstructorError as error:
        where = f" at line {error.problem_mark.line + 1}" if error.problem_mark is not None else ""
        raise YAMLInputError(_unknown_tag(error, where) or f"it is not valid YAML{where}") from None
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        raise YAMLInputError(
            "it is not valid YAML" + (f" at line {mark.line + 1}" if mark is not None else "")
        ) from None
    except RecursionError:
        raise YAMLInputError("it is nested too deeply") from None
    except (ValueError, TypeError, AttributeError, OverflowError) as error:
        # PyYAML's constructors raise plain Python errors for a tag whose value does not parse (!!int x).
        raise YAMLInputError(f"a tagged value cannot be built ({type(error).__name__})") from None
    if count_values(data, MAX_CONFIG_VALUES) > MAX_CONFIG_VALUES:
        raise YAMLInputError(
            f"its aliases expand to more than {MAX_CONFIG_VALUES:,} values (or refer to themselves); write the "
            "values out"
        )
    return data


def parse_value(text: str) -> Any:
    """An override's value as YAML, so numbers, booleans, null and lists work as on the command line; text that is
    not YAML stays text."""
    try:
        return load_yaml(text)
    except YAMLInputError as error:
        if str(error).startswith(("it is not valid YAML", "a tagged value")):
            return text  # a:b, [x, #x ... are text a user meant
        raise  # a key twice, a bomb, too deep, too large: never silently text


def _split(item: str) -> tuple[str, Any]:
    """``key.sub=value`` as (key, parsed value); ConfigError for what is not an override."""
    if "=" not in item:
        raise ConfigError(f"override {excerpt(item)} is not of the form key=value")
    key, _, raw = item.partition("=")
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ConfigError(f"override {excerpt(item)} has an empty key")
    if not raw.strip():
        raise ConfigError(f"override '{key}=' has no value; give one, or leave the key out for its default")
    try:
        return key, parse_value(raw)
    except YAMLInputError as error:
        raise ConfigError(f"override '{key}': {error}") from None


def reject_repeated(overrides: list[str]) -> None:
    """ConfigError naming both when a command line gives a key twice with different values (or a section and a key
    inside it): a person who typed both meant one of them, and the run would silently use the other."""
    given: dict[str, tuple[str, Any]] = {}
    for item in overrides:
        key, value = _split(item)
        if key in given and not _same(given[key][1], value):
            raise ConfigError(f"'{key}' is given twice: {excerpt(given[key][0])} and {excerpt(item)}; give it once")
        for other, (earlier, _) in given.items():
            if other.startswith(f"{key}.") or key.startswith(f"{other}."):
                raise ConfigError(f"{excerpt(earlier)} and {excerpt(item)} set the same setting; give it once")
        given[key] = (item, value)


def _same(a: Any, b: Any) -> bool:
    # 1 and true are equal in Python but not the same setting (workers=1 workers=true)
    return type(a) is type(b) and a == b


def layered(*groups: list[str]) -> list[str]:
    """Command-line items laid over each other: a ``key=value`` whose key comes again later is dropped, so the
    later one wins (what a script that adds its own settings to defaults means); every other item (a command, a
    flag, a path) stays where it is. The result is what such a script hands to ``adloco train``."""
    items = [item for group in groups for item in group]

    def key(item: str) -> str | None:
        return item.partition("=")[0].strip() if "=" in item and not item.startswith("-") else None

    later: set[str] = set()
    kept = []
    for item in reversed(items):
        name = key(item)
        if name is None or name not in later:
            kept.append(item)
        if name is not None:
            later.add(name)
    return kept[::-1]


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply ``key.sub=value`` overrides to a nested dict (a new dict is returned), in order: a later one wins, so
    a program may lay its settings over defaults (the command line refuses contradicting repeats before this,
    ``reject_repeated``). A key without a value is an error, never a silent default."""
    result: dict[str, Any] = copy.deepcopy(data) if data else {}
    for item in overrides:
        key, value = _split(item)
        parts = key.split(".")
        node = result
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {excerpt(item)}: '{part}' is not a section")
            node = child
        node[parts[-1]] = value
    return result
