"""The ``pdflash`` command line: ``main.py`` assembles one module per command."""
