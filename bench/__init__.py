"""The benchmark: `python -m bench serve|compare|multiturn|...` (see __main__.py); one-off measurements live in
bench/experiments/."""
