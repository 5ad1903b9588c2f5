"""A griffe extension for the API reference: docstrings rendered as Python shows them.

* A class whose docstring is completed when its module is imported (a ``{settings}`` placeholder filled from
  `polyamp.LossScaleConfig`'s settings) is documented with the docstring Python sees, cleaned as
  `inspect.getdoc` cleans it, instead of the source text griffe reads.
* A doctest written in a docstring's text (``>>>`` lines and their output, outside an ``Examples:`` section,
  which griffe reads itself) becomes a ``pycon`` code block; Markdown would read its ``>`` as quotes.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

import griffe

#: The placeholder a docstring holds until its module fills it in.
PLACEHOLDER = "{settings}"


def fence_doctests(text: str) -> str:
    """``text`` with each run of doctest lines at the margin (up to the next blank line) in a ``pycon`` fence."""
    out: list[str] = []
    fenced = False  # inside a ``` block of the docstring's own
    in_doctest = False
    for line in text.split("\n"):
        if line.lstrip().startswith("```"):
            fenced = not fenced
        if in_doctest and not line.strip():
            out.append("```")
            in_doctest = False
        elif not fenced and not in_doctest and line.startswith(">>>"):
            if out and out[-1].strip():
                out.append("")
            out.append("```pycon")
            in_doctest = True
        out.append(line)
    if in_doctest:
        out.append("```")
    return "\n".join(out)


class ReferenceDocstrings(griffe.Extension):
    def on_instance(self, *, node: Any, obj: griffe.Object, agent: Any, **kwargs: Any) -> None:
        docstring = obj.docstring
        if docstring is None:
            return
        if PLACEHOLDER in docstring.value and isinstance(obj, griffe.Class):
            runtime = getattr(importlib.import_module(obj.module.path), obj.name)
            docstring.value = inspect.cleandoc(runtime.__doc__ or "")
        if ">>>" in docstring.value:
            docstring.value = fence_doctests(docstring.value)
