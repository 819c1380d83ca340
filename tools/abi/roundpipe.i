/*
 * SWIG interface of the RoundPipe header gate.
 *
 * `swig -xml` on this file dumps every declaration of include/roundpipe.h (functions, callback
 * typedefs, opaque handles, structs, enums and macros) as XML; tools/abi/check_bindings.py reads
 * that dump and compares the bindings against it. Nothing is generated for any target language:
 * the gate only needs SWIG's C parser.
 *
 * SWIG's own stdint.i is deliberately not included, so int32_t & co. stay named as written and
 * the checker maps them to fixed-size types itself. roundpipe.h defines RP_API as nothing under
 * SWIG.
 */
%module roundpipe_abi

%include "roundpipe.h"
