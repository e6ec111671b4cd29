"""The shared library under every reference op: the ragged batch layout (``batch``), argument
checks (``checks``) and synthetic inputs (``synthetic``). Imports no other part of
``reference``."""
