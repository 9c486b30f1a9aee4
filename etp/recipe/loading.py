"""Reading recipes: the YAML loader (``3e-3`` is a float, duplicate keys are errors) and
command-line ``--set key=value`` overrides."""
from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import Any, Iterable

from etp.recipe.validation import RecipeError


# ---------------------------------------------------------------------------------- YAML
@functools.lru_cache(maxsize=None)
def _yaml_loader() -> type:
    import yaml  # local: pyyaml is only needed when reading files

    class RecipeLoader(yaml.SafeLoader):
        """SafeLoader reading ``3e-3`` as a float (YAML 1.2) and refusing duplicate keys."""

        def construct_mapping(self, node, deep=False):  # type: ignore[override]
            seen = set()
            for key_node, _ in node.value:
                key = self.construct_object(key_node, deep=deep)
                if key in seen:
                    raise RecipeError(
                        str(key), None, f"recipe key {key!r} appears twice ({key_node.start_mark})"
                    )
                seen.add(key)
            return super().construct_mapping(node, deep=deep)

    RecipeLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float",
        re.compile(
            r"""^(?:[-+]?(?:[0-9][0-9_]*)\.[0-9_]*(?:[eE][-+]?[0-9]+)?
            |[-+]?(?:[0-9][0-9_]*)(?:[eE][-+]?[0-9]+)
            |\.[0-9_]+(?:[eE][-+]?[0-9]+)?
            |[-+]?\.(?:inf|Inf|INF)
            |\.(?:nan|NaN|NAN))$""",
            re.X,
        ),
        list("-+0123456789."),
    )
    return RecipeLoader


def load_recipe_yaml(path_or_text: str | Path, *, text: bool = False) -> Any:
    """Reads YAML with the recipe loader (``3e-3`` is a float, duplicate keys are errors).
    ``text=True`` parses ``path_or_text`` itself instead of reading a file.

    Raises:
        RecipeError: the file does not exist or cannot be read, or is not valid YAML; the
            message is one line naming the file and the problem (and the line and column).
    """
    import yaml

    where = "override value" if text else f"recipe {path_or_text}"
    if text:
        source = str(path_or_text)
    else:
        try:
            source = Path(path_or_text).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise RecipeError("<file>", str(path_or_text), f"{where}: no such file") from None
        except (OSError, UnicodeDecodeError) as error:
            reason = error.strerror if isinstance(error, OSError) and error.strerror else str(error)
            raise RecipeError("<file>", str(path_or_text), f"{where}: cannot be read ({reason})") from None
    try:
        return yaml.load(source, Loader=_yaml_loader())  # noqa: S506 (a SafeLoader subclass)
    except yaml.YAMLError as error:
        raise RecipeError("<yaml>", str(path_or_text), f"{where} is not valid YAML: {_one_line(error)}") from error


def _one_line(error: Exception) -> str:
    """A YAML error as one line: the problem and where (PyYAML's own text spans several)."""
    problem = getattr(error, "problem", None)
    mark = getattr(error, "problem_mark", None)
    if problem and mark is not None:
        return f"{problem} at line {mark.line + 1}, column {mark.column + 1}"
    return " ".join(str(error).split())


def parse_overrides(items: Iterable[str]) -> dict[str, Any]:
    """Parses command-line overrides ``key=value`` (values read as YAML) into keyword
    arguments for :meth:`Recipe.from_yaml`; ``etp.key=value`` goes to the etp section.

    Example::

        parse_overrides(["train_iters=5", "lr=3e-4", "etp.etp_size=1"])
        # {'train_iters': 5, 'lr': 0.0003, 'etp': {'etp_size': 1}}
    """
    result: dict[str, Any] = {}
    for item in items:
        key, sep, text = str(item).partition("=")
        key = key.strip()
        if not sep or not key:
            raise RecipeError(str(item), None, f"override {item!r}: expected key=value")
        value = load_recipe_yaml(text, text=True) if text.strip() else None
        if key.startswith("etp."):
            result.setdefault("etp", {})[key[4:]] = value
        else:
            result[key] = value
    return result
