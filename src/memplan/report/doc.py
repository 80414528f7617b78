"""A report as a list of blocks, rendered twice: Markdown (figures as files) and self-contained HTML.

The HTML has inline CSS and every figure inline as a data URI (SVG preferred, PNG as fallback), so it opens
offline; it never references http(s). Inline markup in text is the small Markdown subset both renderers
understand: `code`, **bold**, and [text](relative/path).
"""

from __future__ import annotations

import base64
import html
import re
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Heading:
    text: str
    level: int = 2


@dataclass(frozen=True)
class Para:
    text: str


@dataclass(frozen=True)
class Bullets:
    items: tuple[str, ...]


@dataclass(frozen=True)
class Code:
    text: str


@dataclass(frozen=True)
class Table:
    header: tuple[str, ...]
    rows: tuple[tuple[str, ...], ...]
    align_right: tuple[int, ...] = ()  # column indexes shown right-aligned (numbers)


@dataclass(frozen=True)
class Figure:
    """A plot: its caption and the files it was saved as (name → bytes), e.g. {'x.png': b'...', 'x.svg': ...}."""

    caption: str
    stem: str  # path without extension, relative to the page (e.g. '176b-seq32k/components')
    files: dict[str, bytes] = field(default_factory=dict)  # extension ('png', 'svg') → content


Block = Heading | Para | Bullets | Code | Table | Figure

_CODE = re.compile(r"`([^`]+)`")
_BOLD = re.compile(r"\*\*(.+?)\*\*")
_LINK = re.compile(r"\[([^\]]+)\]\(([^)\s]+)\)")
_SCHEME = re.compile(r"https?://")


def _md_cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def to_markdown(blocks: list[Block]) -> str:
    """The page as GitHub-flavoured Markdown; figures link their PNG (shown) and SVG."""
    out: list[str] = []
    for b in blocks:
        if isinstance(b, Heading):
            out.append("#" * b.level + " " + b.text)
        elif isinstance(b, Para):
            out.append(b.text)
        elif isinstance(b, Bullets):
            out.append("\n".join(f"- {item}" for item in b.items))
        elif isinstance(b, Code):
            out.append("```\n" + b.text.rstrip("\n") + "\n```")
        elif isinstance(b, Table):
            sep = ["---:" if i in b.align_right else "---" for i in range(len(b.header))]
            lines = ["| " + " | ".join(_md_cell(c) for c in row) + " |" for row in (b.header, sep, *b.rows)]
            out.append("\n".join(lines))
        elif isinstance(b, Figure):
            links = " · ".join(f"[{ext.upper()}]({b.stem}.{ext})" for ext in b.files)
            out.append(f"![{b.caption}]({b.stem}.png)\n\n*{b.caption}* ({links})")
    return "\n\n".join(out) + "\n"


def _inline_html(text: str) -> str:
    """Escape, then turn `code`, **bold** and [text](path) into tags (links only to relative paths)."""
    s = html.escape(text, quote=True)
    s = _CODE.sub(lambda m: f"<code>{m.group(1)}</code>", s)
    s = _BOLD.sub(lambda m: f"<strong>{m.group(1)}</strong>", s)

    def link(m: re.Match) -> str:
        target = m.group(2)
        if "://" in target or target.startswith("//"):
            return m.group(1)  # no network references in the offline page
        return f'<a href="{target}">{m.group(1)}</a>'

    return _SCHEME.sub("", _LINK.sub(link, s))  # a URL quoted in text stays readable but is no reference


_CSS = """
body { font-family: -apple-system, 'Segoe UI', Helvetica, Arial, sans-serif; max-width: 1100px; margin: 2em auto;
       padding: 0 1em; color: #1f2328; background: #ffffff; line-height: 1.5; }
h1 { border-bottom: 2px solid #d0d7de; padding-bottom: .3em; }
h2 { border-bottom: 1px solid #d0d7de; padding-bottom: .2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 1em 0; font-size: 0.92em; }
th, td { border: 1px solid #d0d7de; padding: 4px 10px; vertical-align: top; }
th { background: #f6f8fa; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
tr:nth-child(even) td { background: #fafbfc; }
code, pre { font-family: ui-monospace, Menlo, Consolas, monospace; background: #f6f8fa; border-radius: 4px; }
code { padding: 1px 4px; }
pre { padding: 10px; overflow-x: auto; }
figure { margin: 1.2em 0; }
figure img { max-width: 100%; border: 1px solid #d0d7de; }
figcaption { font-style: italic; color: #57606a; }
"""


def _figure_html(b: Figure) -> str:
    if "svg" in b.files:
        uri = "data:image/svg+xml;base64," + base64.b64encode(b.files["svg"]).decode("ascii")
    else:
        uri = "data:image/png;base64," + base64.b64encode(b.files.get("png", b"")).decode("ascii")
    alt = html.escape(b.caption, quote=True)
    return f'<figure><img src="{uri}" alt="{alt}"><figcaption>{_inline_html(b.caption)}</figcaption></figure>'


def _block_html(b: Block) -> str:
    if isinstance(b, Heading):
        return f"<h{b.level}>{_inline_html(b.text)}</h{b.level}>"
    if isinstance(b, Para):
        return f"<p>{_inline_html(b.text)}</p>"
    if isinstance(b, Bullets):
        return "<ul>" + "".join(f"<li>{_inline_html(i)}</li>" for i in b.items) + "</ul>"
    if isinstance(b, Code):
        return f"<pre><code>{html.escape(b.text)}</code></pre>"
    if isinstance(b, Table):
        head = "".join(f"<th>{_inline_html(c)}</th>" for c in b.header)
        rows = "".join(
            "<tr>" + "".join(f'<td{" class=num" if i in b.align_right else ""}>{_inline_html(c)}</td>'
                             for i, c in enumerate(row)) + "</tr>" for row in b.rows)
        return f"<table><thead><tr>{head}</tr></thead><tbody>{rows}</tbody></table>"
    return _figure_html(b)


def to_html(blocks: list[Block], title: str) -> str:
    """One self-contained HTML page: inline CSS, figures as data URIs, no external references."""
    body = "\n".join(_block_html(b) for b in blocks)
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head>\n<body>\n{body}\n</body></html>\n")
