"""One short line for a configuration error: the key, the cause, and the nearest name when one was misspelt.

``kdlab`` (the console script, :func:`kdlab.cli.main.entry`) ends every configuration error with
``kdlab: error: <key>: <cause>`` and exit status 2; ``KDLAB_TRACEBACK=1`` or ``--traceback`` shows the
traceback instead. :func:`short_message` turns an exception into that line: jsonargparse's nested
"Does not validate against any of the types ... Expected a <class 'NoneType'> ... Given value:
Namespace(...)" report is reduced to the offending key and kdlab's own message inside it; a class path
or argument that does not exist gets a "did you mean" from the names that do (``difflib``).
"""

from __future__ import annotations

import difflib
import importlib
import inspect
import re

import yaml

from kdlab.errors import ConfigError  # its home is the shared layer, so callbacks can raise it too

__all__ = ["ConfigError", "nearest", "short_message"]


def nearest(name: str, candidates: list[str]) -> str:
    """``" (did you mean 'X'?)"`` for the closest of ``candidates`` to ``name``, or ``""``."""
    match = difflib.get_close_matches(name, sorted(set(candidates)), n=1, cutoff=0.6)
    return f" (did you mean {match[0]!r}?)" if match else ""


def _class_candidates(class_path: str) -> tuple[str, list[str]]:
    """(attribute name, public classes of its module) for ``module.Name``; empty when the module is unknown."""
    module_name, _, name = class_path.rpartition(".")
    try:
        module = importlib.import_module(module_name)
    except Exception:  # noqa: BLE001 - an unknown module: no candidates
        return name, []
    return name, [n for n, value in vars(module).items() if inspect.isclass(value) and not n.startswith("_")]


def _argument_candidates(class_path: str) -> list[str]:
    """The arguments ``class_path`` takes: its ``__init__``'s named parameters and, where it takes ``**settings`` (and
    so, as jsonargparse reads it, its base class's arguments: Coverage's ``examples`` is EvaluationCallback's), those of
    the next ``__init__`` up its bases, and so on."""
    module_name, _, name = class_path.rpartition(".")
    try:
        cls = getattr(importlib.import_module(module_name), name)
    except Exception:  # noqa: BLE001 - an unknown class offers no names
        return []
    names: list[str] = []
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass is object:
            continue
        try:
            parameters = inspect.signature(klass.__init__).parameters.values()
        except (TypeError, ValueError):
            break
        names += [p.name for p in parameters if p.name != "self" and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
        if not any(p.kind == p.VAR_KEYWORD for p in parameters):
            break
    return list(dict.fromkeys(names))


def _subclass_candidates(text: str) -> list[str]:
    """The class names a short class name could have meant: every subclass (kdlab's packages imported) of
    the types jsonargparse's message lists as accepted (``Subtypes: [<class 'kdlab.objectives.kl.KLObjective'>, ...]``)."""
    for package in ("kdlab.objectives", "kdlab.rollouts", "kdlab.tasks", "kdlab.callbacks"):
        try:
            importlib.import_module(package)
        except Exception:  # noqa: BLE001 - a package that cannot be imported offers no names
            pass
    names = []
    for class_path in re.findall(r"<class '([\w.]+)'>", text):
        module_name, _, name = class_path.rpartition(".")
        try:
            base = getattr(importlib.import_module(module_name), name)
        except Exception:  # noqa: BLE001 - builtins (NoneType) and unknown paths offer none
            continue
        pending = [base]
        while pending:
            cls = pending.pop()
            names.append(cls.__name__)
            pending += cls.__subclasses__()
    return [name for name in names if not name.startswith("_")]


_NOISE = re.compile(r"^(Expected a <class 'NoneType'>|Expected a <class|Given value|Subtypes:|Errors:|Does not validate against|Not a valid subclass|Expected a path but|a class path \(str\)|a dict with|a dict without)")


def _causes(text: str) -> list[str]:
    """The items of jsonargparse's ``Errors:`` lists that say what is wrong, in order (not the ``None``
    alternative, not the list of accepted forms)."""
    causes = []
    lines = text.splitlines()
    for index, line in enumerate(lines):
        item = line.strip()
        if not item.startswith("- ") or _NOISE.match(item[2:]):
            continue
        item = item[2:]
        following = index + 1
        while item.endswith(":") and following < len(lines):  # "Problem with given class_path 'X':" + its reason, which
            item = f"{item} {lines[following].strip()}"  # may itself be 'Parser key "chunk_size":' + the cause below it
            following += 1
        causes.append(item)
    return causes


def _key(text: str) -> str | None:
    match = re.search(r'(?:Parser key|key) "([^"]+)"', text)
    return match.group(1) if match else None


def short_message(error: BaseException) -> str | None:
    """The one-line message for a configuration error, or None when ``error`` is not one."""
    if isinstance(error, ConfigError):
        return str(error)
    if isinstance(error, yaml.YAMLError):
        return f"a YAML file does not parse: {error}".replace("\n", " ")
    text = str(error)
    if type(error).__name__ == "ArgumentError" or "Does not validate against any of" in text or 'Parser key "' in text:
        return _jsonargparse_message(text)
    if isinstance(error, (ValueError, TypeError, FileNotFoundError, ImportError, NotADirectoryError)):
        return " ".join(text.split()) or type(error).__name__
    return None


def _jsonargparse_message(text: str) -> str:
    key = _key(text)
    causes = _causes(text)
    cause = causes[0] if causes else " ".join(text.splitlines()[-1].split())
    unknown_class = re.search(r"Problem with given class_path '([\w.]+)':.*has no attribute '(\w+)'", cause)
    if unknown_class:
        name, candidates = _class_candidates(unknown_class.group(1))
        cause = f"no class {unknown_class.group(1)!r}{nearest(name, candidates)}"
    short_name = re.fullmatch(r"Expected a dot import path string: (\w+)", cause)
    if short_name:  # a class given by its name alone that no accepted class has
        cause = f"no class {short_name.group(1)!r}{nearest(short_name.group(1), _subclass_candidates(text))}"
    unknown_option = re.search(r"Problem with given class_path '([\w.]+)':\s*(?:Key|Option) '([\w.]+)' is not accepted", cause)
    if unknown_option:
        option = unknown_option.group(2).rsplit(".", 1)[-1]
        cause = f"{unknown_option.group(1).rsplit('.', 1)[-1]} has no argument {option!r}{nearest(option, _argument_candidates(unknown_option.group(1)))}"
        key = f"{key}.{option}" if key else option
    cause = re.sub(r"^Problem with given class_path '[\w.]+':\s*", "", cause)
    inner = re.match(r'Parser key "([\w.]+)":\s*(.*)', cause)
    if inner:  # an argument of the class given: its key below the class's
        key, cause = (f"{key}.{inner.group(1)}" if key else inner.group(1)), inner.group(2)
    if not causes and "Errors:" in text:  # every alternative type failed: say which and what was given
        kind = re.search(r"Not a valid subclass of \w+", text)
        given = re.search(r"Given value: (.*)", text)
        cause = f"not a valid value ({kind.group(0) if kind else 'no accepted type'}" + (f"; given {given.group(1)[:200]})" if given else ")")
    elif not causes:  # a plain "Parser key "x": Expected a <class 'float'>. Got value: abc"
        plain = re.search(r'Parser key "[^"]+":\s*(.*)', text, flags=re.S)
        cause = " ".join(plain.group(1).split()) if plain else cause
    return f"{key}: {cause}" if key and not cause.startswith(key) else cause
