"""The Triton Python-backend models of the emitted repository, and their pure converters.

Model modules (`preprocessing`, `tensorrt_llm`, `postprocessing`, `tensorrt_llm_bls`) import
`triton_python_backend_utils` and are thin adapters. Everything they compute lives in pure
modules (`word_list`, `detokenizer`, `request_converter`, `text_request`, `response_converter`)
that tests exercise without Triton.
"""
