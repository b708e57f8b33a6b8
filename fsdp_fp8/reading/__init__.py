"""The reading engine: how a rank pulls its rows off the disk (a schedule of coalesced reads,
``preadv`` or ``O_DIRECT``, staging into device memory, page-cache prefetch, each rank's byte
count). ``format`` says what the files mean; this layer reads them for ``load`` and ``save``."""
