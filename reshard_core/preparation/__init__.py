"""Preparing a refit session (what ``prepare`` and ``refit`` do before any data moves): from the
models a rank holds to its plan.

``pipeline`` runs the stages in order (extract → agree → exchange → plan); ``sides`` decides
whether the two models meet in the logical (HF checkpoint) space and describes each side there;
``coverage`` checks that a destination format writes every element of its parameters exactly once.
"""
