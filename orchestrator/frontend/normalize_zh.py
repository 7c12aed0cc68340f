"""Mandarin text normalisation: numerals, dates, times, money, units and symbols in Chinese."""

from __future__ import annotations

import re
from typing import Any

_DIGITS = "零一二三四五六七八九"
# measure words (and number units) after which a lone 2 is read 两
_MEASURES = (
    "个 位 次 件 本 只 条 张 天 年 岁 种 倍 家 辆 台 块 元 角 毛 杯 碗 份 名 双 对 把 斤 米 "
    "公里 公斤 千克 克 升 吨 小时 分钟 秒钟 周 星期 人 层 间 部 首 句 页 篇 场 票 架 艘 头 "
    "匹 棵 朵 片 颗 粒 根 支 门 所 座 栋 套 节 遍 趟 顿 声 口 下 万 亿 千 百 项 点 分 秒"
).split()
_UNITS = {
    "km/h": "公里每小时",
    "kph": "公里每小时",
    "mph": "英里每小时",
    "m/s": "米每秒",
    "km": "公里",
    "cm": "厘米",
    "mm": "毫米",
    "m": "米",
    "kg": "公斤",
    "mg": "毫克",
    "g": "克",
    "t": "吨",
    "ml": "毫升",
    "mL": "毫升",
    "L": "升",
    "°C": "摄氏度",
    "°F": "华氏度",
    "°": "度",
    "ms": "毫秒",
    "min": "分钟",
    "h": "小时",
    "s": "秒",
    "kHz": "千赫",
    "MHz": "兆赫",
    "GHz": "吉赫",
    "Hz": "赫兹",
    "kWh": "千瓦时",
    "kW": "千瓦",
    "W": "瓦",
    "V": "伏",
    "mAh": "毫安时",
}
_CURRENCY = {"¥": "元", "$": "美元", "€": "欧元", "£": "英镑"}
_SYMBOLS = {
    "+": "加",
    "=": "等于",
    "×": "乘",
    "÷": "除以",
    "&": "和",
    "#": "井号",
    "@": "艾特",
    "%": "百分号",
    "~": "到",
    "*": "",
    "_": " ",
    "`": "",
    "^": "",
    "|": "，",
    "\\": " ",
}
_PUNCT = {",": "，", "!": "！", "?": "？", ";": "；", ":": "：", "(": "（", ")": "）"}
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?"


def digits_zh(s: str, *, yao: bool = False) -> str:
    """Digits one by one: "2026" -> "二零二六"; yao=True reads 1 as 幺 (phone numbers)."""
    return "".join(("幺" if yao and c == "1" else _DIGITS[int(c)]) for c in s if c.isdigit())


def cardinal_zh(n: int, *, liang: bool = True) -> str:
    """An integer in Chinese: 10001 -> 一万零一; liang=True gives 两千 / 两万 for a leading 2."""
    if n < 0:
        return "负" + cardinal_zh(-n, liang=liang)
    if n >= 10**16:  # past 千万亿, what cn2an reads: digit by digit
        return digits_zh(str(n))
    from cn2an import an2cn  # imported on first use (FrontEnd.warmup): it takes 0.2 s

    out = an2cn(str(n))
    if liang and out.startswith("二") and out[1:2] in ("百", "千", "万", "亿"):
        out = "两" + out[1:]
    return out


def number_zh(s: str, *, liang: bool = False) -> str:
    """A written number ("1,234.5", "-3") in Chinese; decimals digit by digit after 点."""
    s = s.replace(",", "")
    sign = "负" if s.startswith("-") else ""
    whole, _, frac = s.lstrip("-+").partition(".")
    said = cardinal_zh(int(whole or "0"), liang=liang)
    if frac:
        said += "点" + digits_zh(frac)
    return sign + said


def _count(s: str) -> str:
    """A number before a measure word: a lone 2 is 两."""
    return "两" if s == "2" else number_zh(s, liang=True)


def _money(match: re.Match) -> str:
    sign = "负" if match["neg"] else ""
    whole, frac, unit = match["amount"].replace(",", ""), match["frac"], _CURRENCY[match["cur"]]
    if unit != "元" or (frac and len(frac) > 2):
        return sign + (number_zh(f"{whole}.{frac}") if frac else _count(whole)) + unit
    jiao, fen = (int(c) for c in (frac or "").ljust(2, "0"))
    said = _count(whole) + "元" if int(whole) else ""
    if jiao:
        said += _DIGITS[jiao] + "角"
    elif fen and said:
        said += "零"
    if fen:
        said += _DIGITS[fen] + "分"
    return sign + (said or "零元")


def _time(match: re.Match) -> str:
    h, m, s = int(match[1]), int(match[2]), int(match[3] or 0)
    said = ("两" if h == 2 else cardinal_zh(h)) + "点"
    if m or s:
        said += ("零" if 0 < m < 10 else "") + cardinal_zh(m) + "分"
    if s:
        said += ("零" if s < 10 else "") + cardinal_zh(s) + "秒"
    return said


def _date(match: re.Match) -> str:
    y, m, d = match["y"], int(match["m"]), match["d"]
    said = (digits_zh(y) + "年" if y else "") + cardinal_zh(m) + "月"
    return said + (cardinal_zh(int(d)) + (match["suffix"] or "日") if d else "")


def _phone(match: re.Match, yao: bool) -> str:
    text = match[0]
    said = " ".join(digits_zh(g, yao=yao) for g in re.findall(r"\d+", text))
    return ("加" if text.startswith("+") else "") + said


_UNIT_PATTERN = (
    rf"(-?(?:{_NUM}))\s?("
    + "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
    + r")(?![A-Za-z/])"
)

_RULES: tuple[tuple[re.Pattern, Any], ...] = tuple(
    (re.compile(p), r)
    for p, r in (
        (
            r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+|(?:https?://)?(?:www\.)?[\w-]+(?:\.[\w-]+)*"
            r"\.(?:com|cn|org|net|io|edu|gov)\b(?:/[\w./-]*)?",
            lambda m: (
                re.sub(r"^https?://", "", m[0])
                .replace(".", "点")
                .replace("@", "艾特")
                .replace("/", "斜杠")
            ),
        ),
        (
            r"(?<!\d)(?P<y>\d{4})[-/.年](?P<m>1[0-2]|0?[1-9])[-/.月](?P<d>3[01]|[12]\d|0?[1-9])"
            r"(?P<suffix>[日号])?(?!\d)",
            _date,
        ),
        (
            r"(?<!\d)(?P<y>\d{4})年(?P<m>1[0-2]|0?[1-9])月"
            r"(?:(?P<d>3[01]|[12]\d|0?[1-9])(?P<suffix>[日号]))?",
            _date,
        ),
        (r"(?<!\d)(\d{4})年", lambda m: digits_zh(m[1]) + "年"),
        (
            r"(?<!\d)(?P<y>)(?P<m>1[0-2]|0?[1-9])月(?:(?P<d>3[01]|[12]\d|0?[1-9])(?P<suffix>[日号]))?",
            _date,
        ),
        (r"(?<!\d)(3[01]|[12]\d|0?[1-9])([日号])", lambda m: cardinal_zh(int(m[1])) + m[2]),
        (r"(?<![\d:])([01]?\d|2[0-3])[:：]([0-5]\d)(?:[:：]([0-5]\d))?(?![\d:])", _time),
        (
            r"(?P<neg>-)?(?P<cur>[¥$€£])\s?(?P<amount>\d{1,3}(?:,\d{3})+|\d+)(?:\.(?P<frac>\d+))?",
            _money,
        ),
        (rf"(-?(?:{_NUM}))\s?%", lambda m: "百分之" + number_zh(m[1])),
        (rf"(-?(?:{_NUM}))\s?‰", lambda m: "千分之" + number_zh(m[1])),
        (r"第\s?(\d+)", lambda m: "第" + cardinal_zh(int(m[1]), liang=False)),
        (
            r"(?<![\d.])(\d{1,3})/(\d{1,3})(?![\d/])",
            lambda m: (
                cardinal_zh(int(m[2]), liang=False) + "分之" + cardinal_zh(int(m[1]), liang=False)
            ),
        ),
        (rf"(?<![\d.])({_NUM})(?:-|\s?[~～—]\s?)(?=\d)", lambda m: number_zh(m[1]) + "到"),
        (r"(?<=\d) - (?=\d)", "减"),
        (r"(?<![A-Za-z0-9.])-(?=\d)", "负"),
        (_UNIT_PATTERN, lambda m: _count(m[1]) + _UNITS[m[2]]),
        (rf"(?<![\d.])({_NUM})\s?(?=(?:{'|'.join(_MEASURES)}))", lambda m: _count(m[1])),
        (_NUM, lambda m: number_zh(m[0])),
    )
)
_PHONE_RULES = (
    re.compile(r"(?<!\d)\+\d{1,3}[\s-]?\d{2,4}(?:[\s-]?\d{3,4}){1,3}(?!\d)"),
    re.compile(r"(?<!\d)1[3-9]\d[\s-]?\d{4}[\s-]?\d{4}(?!\d)"),
    re.compile(r"(?<!\d)(?:0\d{2,3}|400|800)-\d{3,4}-?\d{4}(?!\d)"),
    re.compile(r"(?<![\d.])(?:0\d{4,}|\d{12,})(?![\d.])"),
)


def normalize_zh(text: str, *, yao: bool = False) -> str:
    """Mandarin text with numbers, dates, times, money, units and symbols in Chinese characters."""
    text = _to_halfwidth(text)
    for pattern in _PHONE_RULES:
        text = pattern.sub(lambda m: _phone(m, yao), text)
    for pattern, repl in _RULES:
        text = pattern.sub(repl, text)
    text = "".join(_SYMBOLS.get(c, c) for c in text)
    text = "".join(_PUNCT.get(c, c) for c in text)
    text = re.sub(r"(?<=[\u3400-\u9fff”’」』）])\.(?!\w)", "。", text)
    text = re.sub(r"\s+", " ", text).strip()
    return re.sub(r"\s*([，。！？；：、）])\s*", r"\1", text)


def _to_halfwidth(text: str) -> str:
    """Full-width ASCII (digits, letters, symbols) to half-width; Chinese punctuation is kept."""
    out = []
    for c in text:
        code = ord(c)
        if 0xFF01 <= code <= 0xFF5E and c not in "，！？；：（）":
            c = chr(code - 0xFEE0)
        elif c == "\u3000":
            c = " "
        elif c == "￥":
            c = "¥"
        elif c == "℃":
            c = "°C"
        out.append(c)
    return "".join(out)
