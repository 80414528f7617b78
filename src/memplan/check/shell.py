"""Splitting shell text into commands and words as bash does, in one linear pass, running nothing.

`shell_commands(text)` is what memplan.check.launch reads a launch line with (shlex.split is quadratic in the
length of a word, knows no control operators, so ``--micro-batch-size 1;`` came back as ``1;``).
"""

from __future__ import annotations

import re

from ..errors import InputError

#: the shell's control operators: each ends a command (bash(1), DEFINITIONS: || & && ; ;; ( ) | |& newline)
_CONTROL = ("&&", "||", ";;", "|&", ";", "&", "|", "(", ")")
#: redirection operators (bash(1), REDIRECTION); the word after one is a file name, not an argument
_REDIRECT = re.compile(r"&>>|&>|>>|>&|<&|<>|>\||<<<|<<-|<<|>|<")
#: a run of ordinary characters: none of blank, quote, backslash, operator, backtick or $
_PLAIN = re.compile(r"[^\s'\"\\;&|<>()`$]+")
def _closing(text: str, i: int, flag: str) -> int:
    """The index after the ')' closing the '$(' at ``i`` (nested parentheses and quotes skipped)."""
    depth, j, n = 0, i + 1, len(text)
    while j < n:
        c = text[j]
        if c == "\\":
            j += 2
            continue
        if c in "'\"":
            k = text.find(c, j + 1)
            if k < 0:
                break
            j = k + 1
            continue
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
            if depth == 0:
                return j + 1
        j += 1
    raise InputError(flag, "a $( has no closing ); allowed: a complete shell command")


def shell_commands(text: str, flag: str = "--launch") -> list[list[str]]:
    """The simple commands of shell ``text``, each as its words, in one pass (linear in the text).

    Follows bash's quoting (single quotes literal; double quotes with backslash before $ ` " \\ newline;
    backslash-newline continues the line), comments (# at the start of a word), control operators (; & && ||
    | |& ( ) and newline end a command) and redirections (dropped with their target). $(...) and backticks
    are kept as literal text: nothing is expanded, nothing is ever run. A word longer than MAX_WORD_CHARS is
    refused (execve's MAX_ARG_STRLEN) before it is built.
    """
    from ..inputs import MAX_WORD_CHARS

    commands: list[list[str]] = [[]]
    parts: list[str] | None = None  # the word being built, None between words
    size = 0  # characters in parts
    digits_only = False  # the word so far is an unquoted number (an fd before a redirection: 2>)
    redirect = False  # the next word is a redirection target
    i, n = 0, len(text)

    def add(piece: str, plain_digits: bool = False) -> None:
        nonlocal parts, size, digits_only
        if parts is None:
            parts, size, digits_only = [], 0, True
        parts.append(piece)
        size += len(piece)
        digits_only = digits_only and plain_digits
        if size > MAX_WORD_CHARS:
            raise InputError(flag, f"a word of over {MAX_WORD_CHARS} characters; allowed: words of at most "
                                   f"{MAX_WORD_CHARS} characters (MAX_ARG_STRLEN: execve refuses a longer one)")

    def end_word() -> None:
        nonlocal parts, redirect
        if parts is not None:
            if redirect:
                redirect = False
            else:
                commands[-1].append("".join(parts))
            parts = None

    def end_command() -> None:
        end_word()
        if commands[-1]:
            commands.append([])

    while i < n:
        c = text[i]
        if c in " \t\r":
            end_word()
            i += 1
        elif c == "\n":
            end_command()
            i += 1
        elif c == "#" and parts is None:
            j = text.find("\n", i)
            i = n if j < 0 else j
        elif c == "\\":
            if text.startswith("\n", i + 1):
                i += 2  # line continuation
            elif text.startswith("\r\n", i + 1):
                i += 3
            else:
                add(text[i + 1:i + 2] or "\\")
                i += 2
        elif c == "'":
            j = text.find("'", i + 1)
            if j < 0:
                raise InputError(flag, "a ' quote is not closed; allowed: a complete shell command")
            add(text[i + 1:j])
            i = j + 1
        elif c == '"':
            i = _double_quoted(text, i, add, flag)
        elif c == "`":
            j = text.find("`", i + 1)
            if j < 0:
                raise InputError(flag, "a ` quote is not closed; allowed: a complete shell command")
            add(text[i:j + 1])  # command substitution: kept as text, never run
            i = j + 1
        elif c == "$" and text.startswith("$(", i):
            j = _closing(text, i, flag)
            add(text[i:j])  # kept as text, never run
            i = j
        elif c in "<>" or (c == "&" and text.startswith("&>", i)):
            if parts is not None and digits_only:
                parts = None  # 2>: the number is the file descriptor, not an argument
            end_word()
            op = _REDIRECT.match(text, i).group()
            i += len(op)
            if op in (">&", "<&"):
                m = re.compile(r"[0-9]+-?|-").match(text, i)
                if m:  # 2>&1, 1>&-: duplicates a descriptor, takes no file name
                    i = m.end()
                    continue
            redirect = True
        elif c in ";&|()":
            op = next(o for o in _CONTROL if text.startswith(o, i))
            end_command()
            i += len(op)
        else:
            m = _PLAIN.match(text, i)
            piece = m.group() if m else c
            add(piece, piece.isdigit() and piece.isascii())
            i += len(piece)
    end_command()
    return [words for words in commands if words]


_IN_DOUBLE = re.compile(r'[^"\\\\]+')


def _double_quoted(text: str, i: int, add, flag: str) -> int:
    """Add the contents of the double-quoted string at ``i`` (in pieces, so the word cap applies as it
    grows); the index after its closing quote."""
    j, n = i + 1, len(text)
    add("")
    while j < n:
        m = _IN_DOUBLE.match(text, j)
        if m:
            add(m.group())
            j = m.end()
            continue
        if text[j] == '"':
            return j + 1
        nxt = text[j + 1:j + 2]
        if nxt == "\n":
            j += 2  # continuation inside quotes
        elif nxt in ('"', "\\", "$", "`"):
            add(nxt)
            j += 2
        else:
            add("\\")
            j += 1
    raise InputError(flag, 'a " quote is not closed; allowed: a complete shell command')
