"""-D NAME=VALUE: a kernel variant, compiled with that -D value in place of the plan's
(gpu/plan.py's kernel_defines), for scripts/bench.py and scripts/kernels.py."""

from __future__ import annotations

import re

import click


def define_option(help: str):
    """The -D option, any number of times."""
    return click.option("-D", "--define", "defines", multiple=True, metavar="NAME=VALUE", help=help)


def parse_defines(defines) -> dict[str, int]:
    """{NAME: VALUE} of the -D options given; a usage error names a malformed one, or a
    NAME that no kernel source mentions (a typo would compile the kernels unchanged)."""
    from deggs.numerics.gpu.compile import kernel_files, read_kernel_file

    overrides = {}
    for d in defines:
        name, _, value = d.partition("=")
        try:
            overrides[name] = int(value)
        except ValueError:
            raise click.UsageError(f"-D {d}: give NAME=VALUE, VALUE an integer") from None
    if overrides:
        text = "\n".join(read_kernel_file(f) for f in kernel_files())
        for name in overrides:
            if not re.search(rf"\b{re.escape(name)}\b", text) or not name.isidentifier():
                raise click.UsageError(f"-D {name}: no kernel source mentions {name}")
    return overrides
