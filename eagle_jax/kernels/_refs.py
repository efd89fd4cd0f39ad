"""Reference-list unpacking shared by the Pallas kernel bodies."""

from __future__ import annotations


def split_refs(refs, has_bias: bool, has_init: bool):
    """refs = (x, g, w, [bias], [aliased init], out, *scratch)
    -> (x, g, w, bias or None, (out, *scratch)).

    The aliased init buffer (a poisoned output the kernel must overwrite) is
    skipped: it is the same memory as `out` and never read.
    """
    x_ref, g_ref, w_ref, pos = refs[0], refs[1], refs[2], 3
    b_ref = None
    if has_bias:
        b_ref, pos = refs[pos], pos + 1
    if has_init:
        pos += 1
    return x_ref, g_ref, w_ref, b_ref, refs[pos:]
