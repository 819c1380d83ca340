"""The header gate's parts: the header model (SWIG), its conventions, one reader per binding."""
