"""An experience type whose decorator (``broken.kind``) and entry point (``broken.renamed``)
name it differently: the decorator's name is the one used."""

import msgspec

from mutualrl.exchange import experience_type


@experience_type("broken.kind")
class Renamed(msgspec.Struct, frozen=True, kw_only=True):
    text: str
