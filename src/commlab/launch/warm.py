"""Imported by the fork servers the workers are forked from (their preload lists): what every
worker would otherwise do itself before its first step, done once in the server. Importing this
module is its whole purpose: the run schema's validator is built and every registered method,
model and dataset imported (:func:`commlab.config.warm_up`)."""

from commlab.config import warm_up

warm_up()
