"""What the commands run: the launcher (``runner``: parse in ``arguments``, run, print with
``reports``), ``python -m fsdp_fp8`` (``commands``), the embedded demo and the clean exit.
The application layer: it may quiet other libraries' noise (``noise``), which the library
itself never does."""
