"""llama.cpp through llama-cpp-python: the backend, speculative heads, RPC devices, the load probe and flash trial."""
