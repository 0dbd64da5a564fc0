"""Solutions of the notebooks' exercises, one module per notebook (named as in ``utils.exercises``).

They live outside the notebooks on purpose: the notebooks ship stubs. ``tests/test_exercises.py`` proves that every
check accepts these and rejects the stubs and plausible wrong answers.
"""
