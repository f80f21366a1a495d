"""Each served stage's request handling, apart from Triton: requests in, responses out, as plain data.

A stage (``encoder.EncoderStage``, ``decoder.DecoderStage``, ``ranker.RankerStage``) takes a list of
``messages.StageRequest`` (named numpy arrays, the sequence id and flags) and answers each with a
``messages.StageResponse`` (named numpy arrays, or an error with its gRPC status), so it can be driven
and tested in one process with no server. Each Triton model's ``model.py`` is a thin adapter over
its stage: ``startup`` makes the start every stage shares (its config's parameters, the version's
own copy of the package, threads and the garbage collector), ``stub`` turns Triton's requests into
plain ones and the answers back into Triton's.
"""
