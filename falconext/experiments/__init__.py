"""The Falcon paper's evaluation (section 7), one experiment per figure or table.

``falconext experiment list`` names them; ``falconext experiment run NAME [--quick] --out
DIR`` writes ``DIR/NAME/results.csv``, ``figure.png`` and ``table.md`` (the paper's number
beside the measured one). Each experiment module holds a pure ``measure(quick)`` that
returns plain rows and comparisons, and a ``draw(result, path)``; ``registry`` lists them
and ``runner`` does the file writing.
"""
