"""Click pieces every `mars` subcommand may use (no import of the command modules)."""

from __future__ import annotations

import math

import click


class Finite(click.FloatRange):
    """A float option that refuses nan and infinities as well as values outside its range."""

    def convert(self, value, param, ctx):
        number = super().convert(value, param, ctx)
        if not math.isfinite(number):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        return number
