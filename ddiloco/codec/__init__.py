"""Tensor codecs of the wire: the `Codec` base class (`base`), one module per family (`float`: fp32, bf16;
`blockwise`: int8, int4, int2) and the registry by name (`registry`)."""
