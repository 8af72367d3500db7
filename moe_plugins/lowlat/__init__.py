"""The low-latency family shared by DeepEP LL and NIXL EP: the kernels' limits (``limits``), the
glue to the vendor runtimes that DeepEP's normal mode uses too (``vendor``), the manager that owns
the library buffer (``manager``) and the prepare/finalize that makes the library calls
(``prepare_finalize``)."""
