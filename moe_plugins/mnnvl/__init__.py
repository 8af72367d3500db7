"""The flashinfer MNNVL family (``flashinfer_nvlink_two_sided``, ``flashinfer_nvlink_one_sided``):
the shared manager half and comm adaptor (:mod:`.manager`) and the shared prepare/finalize
(:mod:`.prepare_finalize`)."""
