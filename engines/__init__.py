"""Everything that turns token ids into token ids: the Engine protocol, the registry, the MoE
runtime and the engines built on it. Importing this package imports neither torch nor triton."""
