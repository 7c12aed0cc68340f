"""English text normalisation: numbers, dates, times, money, units, abbreviations and symbols."""

from __future__ import annotations

import re
import unicodedata

from num2words import num2words

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen"
).split()
_TENS = ("", "", "twenty", "thirty", "forty", "fifty", "sixty", "seventy", "eighty", "ninety")
MONTHS = (
    "January February March April May June July August September October November December"
).split()


def _us(words: str) -> str:
    """num2words' British wording in US style: no "and" inside a number, no commas."""
    return words.replace(" and ", " ").replace(",", "")


def cardinal(n: int) -> str:
    """An integer in words, US style ("one hundred twenty-three"); huge ones digit by digit."""
    if n < 0:
        return "minus " + cardinal(-n)
    if n >= 10**18:
        return digits(str(n))
    return _us(num2words(n))


def ordinal(n: int) -> str:
    """An ordinal in words: 22 -> "twenty-second"."""
    if n >= 10**18:
        return digits(str(n)) + "th"
    return _us(num2words(n, to="ordinal"))


def year(n: int) -> str:
    """A year as spoken: 1999 -> "nineteen ninety-nine", 2005 -> "two thousand five"."""
    if not 1000 <= n <= 9999:
        return cardinal(n)
    return _us(num2words(n, to="year")).replace("oh-", "oh ")


def digits(s: str) -> str:
    """Digits one by one: "007" -> "zero zero seven"."""
    return " ".join(_ONES[int(c)] for c in s if c.isdigit())


def number(s: str) -> str:
    """A written number ("1,234.5", "-3", ".5") in words; decimals read digit by digit."""
    s = s.replace(",", "")
    sign = "minus " if s.startswith(("-", "\u2212")) else ""
    whole, _, frac = s.lstrip("-\u2212+").partition(".")
    words = cardinal(int(whole)) if whole else ""
    if frac:
        words = f"{words} point {digits(frac)}".strip()
    return sign + words


def _plural(words: str) -> str:
    return words[:-1] + "ies" if words.endswith("y") else words + "s"


# --- patterns -----------------------------------------------------------------------------------
_NUM = r"\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?|\.\d+"
_MONTH = (
    r"(Jan(?:uary)?|Feb(?:ruary)?|Mar(?:ch)?|Apr(?:il)?|May|June?|July?|Aug(?:ust)?"
    r"|Sep(?:t(?:ember)?)?|Oct(?:ober)?|Nov(?:ember)?|Dec(?:ember)?)"
)
_CURRENCIES = {
    "$": ("dollar", "dollars", "cent", "cents"),
    "€": ("euro", "euros", "cent", "cents"),
    "£": ("pound", "pounds", "penny", "pence"),
    "¥": ("yen", "yen", None, None),
    "₹": ("rupee", "rupees", None, None),
    "₩": ("won", "won", None, None),
}
_CODES = {
    "USD": ("US dollar", "US dollars"),
    "EUR": ("euro", "euros"),
    "GBP": ("pound", "pounds"),
    "JPY": ("yen", "yen"),
    "CNY": ("yuan", "yuan"),
    "RMB": ("yuan", "yuan"),
}
_SCALE_WORDS = {
    "k": "thousand",
    "K": "thousand",
    "m": "million",
    "M": "million",
    "mn": "million",
    "b": "billion",
    "B": "billion",
    "bn": "billion",
}
_UNITS = {
    "km": ("kilometer", "kilometers"),
    "m": ("meter", "meters"),
    "cm": ("centimeter", "centimeters"),
    "mm": ("millimeter", "millimeters"),
    "kg": ("kilogram", "kilograms"),
    "g": ("gram", "grams"),
    "mg": ("milligram", "milligrams"),
    "lb": ("pound", "pounds"),
    "lbs": ("pounds", "pounds"),
    "oz": ("ounce", "ounces"),
    "mi": ("mile", "miles"),
    "ft": ("foot", "feet"),
    "yd": ("yard", "yards"),
    "mph": ("mile per hour", "miles per hour"),
    "km/h": ("kilometer per hour", "kilometers per hour"),
    "kph": ("kilometer per hour", "kilometers per hour"),
    "m/s": ("meter per second", "meters per second"),
    "°C": ("degree Celsius", "degrees Celsius"),
    "°F": ("degree Fahrenheit", "degrees Fahrenheit"),
    "°": ("degree", "degrees"),
    "L": ("liter", "liters"),
    "ml": ("milliliter", "milliliters"),
    "mL": ("milliliter", "milliliters"),
    "Hz": ("hertz", "hertz"),
    "kHz": ("kilohertz", "kilohertz"),
    "MHz": ("megahertz", "megahertz"),
    "GHz": ("gigahertz", "gigahertz"),
    "KB": ("kilobyte", "kilobytes"),
    "kB": ("kilobyte", "kilobytes"),
    "MB": ("megabyte", "megabytes"),
    "GB": ("gigabyte", "gigabytes"),
    "TB": ("terabyte", "terabytes"),
    "Mbps": ("megabit per second", "megabits per second"),
    "Gbps": ("gigabit per second", "gigabits per second"),
    "ms": ("millisecond", "milliseconds"),
    "sec": ("second", "seconds"),
    "min": ("minute", "minutes"),
    "h": ("hour", "hours"),
    "hr": ("hour", "hours"),
    "hrs": ("hours", "hours"),
    "W": ("watt", "watts"),
    "kW": ("kilowatt", "kilowatts"),
    "kWh": ("kilowatt hour", "kilowatt hours"),
    "V": ("volt", "volts"),
    "mAh": ("milliamp hour", "milliamp hours"),
}
_UNIT_PATTERN = (
    rf"(?<![\w.])(-?(?:{_NUM}))\s?("
    + "|".join(re.escape(u) for u in sorted(_UNITS, key=len, reverse=True))
    + r")(?![\w/])"
)
_ABBREVIATIONS = {
    "Mr.": "Mister",
    "Mrs.": "Missus",
    "Ms.": "Miz",
    "Prof.": "Professor",
    "Jr.": "Junior",
    "Sr.": "Senior",
    "Mt.": "Mount",
    "Ave.": "Avenue",
    "Blvd.": "Boulevard",
    "Gen.": "General",
    "Capt.": "Captain",
    "Lt.": "Lieutenant",
    "Sgt.": "Sergeant",
    "Gov.": "Governor",
    "Sen.": "Senator",
    "Rev.": "Reverend",
    "vs.": "versus",
    "etc.": "et cetera",
    "e.g.": "for example",
    "i.e.": "that is",
    "approx.": "approximately",
    "Inc.": "Incorporated",
    "Ltd.": "Limited",
    "Corp.": "Corporation",
    "Dept.": "Department",
    "Fig.": "Figure",
    "cf.": "compare",
    "E.g.": "For example",
    "I.e.": "That is",
    "Etc.": "Et cetera",
    "Vs.": "Versus",
}
_ABBREV_RE = re.compile(
    r"(?<![\w.])(" + "|".join(re.escape(a) for a in _ABBREVIATIONS) + r")(?=\W|$)"
)
_SYMBOLS = {
    "&": " and ",
    "+": " plus ",
    "=": " equals ",
    "%": " percent ",
    "×": " times ",
    "÷": " divided by ",
    "±": " plus or minus ",
    "°": " degrees ",
    "§": " section ",
    "|": ", ",
    "~": " ",
    "*": " ",
    "_": " ",
    "`": " ",
    "^": " ",
    "\\": " ",
    "<": " less than ",
    ">": " greater than ",
    "@": " at ",
    "#": " number ",
    "/": " slash ",
}
_VULGAR = {
    "½": "a half",
    "¼": "a quarter",
    "¾": "three quarters",
    "⅓": "a third",
    "⅔": "two thirds",
}
_YEAR_CUES = (
    r"in|since|by|from|until|till|to|through|of|year|during|before|after|around|circa"
    r"|early|late|mid|summer|winter|spring|autumn|fall|between|and"
)


def _month(token: str) -> str:
    return next(m for m in MONTHS if m.lower().startswith(token.lower()[:3]))


def _date(y: int | None, m: int, d: int) -> str | None:
    if not (1 <= m <= 12 and 1 <= d <= 31):
        return None
    said = f"{MONTHS[m - 1]} {ordinal(d)}"
    return f"{said}, {year(y)}" if y is not None else said


def _iso_date(match: re.Match) -> str:
    y, m, d = (int(g) for g in match.groups())
    return _date(y, m, d) or match[0].replace("-", " ")


def _numeric_date(match: re.Match) -> str:
    a, b, y = (int(g) for g in match.groups())
    month, day = (b, a) if a > 12 else (a, b)  # US order unless the first part cannot be a month
    return _date(y, month, day) or match[0]


def _named_date(match: re.Match) -> str:
    month, day, y = match["month"], match["day"], match["year"]
    if not day:
        return f"{_month(month)} {year(int(y))}"
    return _date(int(y) if y else None, MONTHS.index(_month(month)) + 1, int(day)) or match[0]


def _day_first_date(match: re.Match) -> str:
    """ "The 1st of May, 2024" and "1 May 2024" read day first: "the first of May, ..."."""
    day, y = int(match["day"]), match["year"]
    if not 1 <= day <= 31:
        return match[0]
    said = f"{ordinal(day)} of {_month(match['month'])}"
    if not re.search(r"\bthe\s+$", match.string[: match.start()], re.IGNORECASE):
        said = "the " + said  # "on 5 June" is said "on the fifth of June"
    return f"{said}, {year(int(y))}" if y else said


def _time(match: re.Match) -> str:
    h, mins, secs = int(match["h"]), int(match["m"] or 0), int(match["s"] or 0)
    ampm = (match["ap"] or match["ap2"] or "").upper()
    said = cardinal(h)
    if mins:
        said += f" {'oh ' if mins < 10 else ''}{cardinal(mins)}"
    elif not ampm:
        said += " o'clock"
    if secs:
        said += f" and {cardinal(secs)} second{'' if secs == 1 else 's'}"
    if not ampm:
        return said
    after = match.string[match.end() :]
    dotted_end = match["ap"] and (not after.strip() or re.match(r"\s+[A-Z]", after))
    return f"{said} {ampm}M" + ("." if dotted_end else "")  # "at 7 a.m." keeps its full stop


def _title_or_street(match: re.Match) -> str:
    """ "Dr."/"St." after a place name is Drive/Street; before a name (or alone) Doctor/Saint."""
    before, after = match.string[: match.start()], match.string[match.end() :]
    prev = re.search(r"([A-Za-z]+)\s+$", before)
    place = False
    if prev is not None and prev[1][0].isupper():
        head = before[: prev.start()].rstrip()
        sentence_start = not head or head[-1] in ".!?"
        place = not sentence_start or not re.match(r"\s+[A-Z]", after)
    title, street = ("Doctor", "Drive") if match[1] == "Dr" else ("Saint", "Street")
    if not place:
        return title
    ends_sentence = not after.strip() or re.match(r"\s+[A-Z]", after)
    return street + "." if ends_sentence else street  # "221B Baker St." keeps its full stop


def _phone(match: re.Match) -> str:
    text = match[0]
    groups = re.findall(r"\d+", text)
    said = ", ".join(digits(g) for g in groups)
    return ("plus " if text.lstrip().startswith("+") else "") + said


def _money(match: re.Match) -> str:
    one, many, sub_one, sub_many = _CURRENCIES[match["cur"]]
    sign = "minus " if match["neg"] else ""
    whole, frac = match["amount"].replace(",", ""), match["frac"]
    scale = match["scale"] or _SCALE_WORDS.get(match["abbr"] or "")
    if scale:
        return f"{sign}{number(whole + ('.' + frac if frac else ''))} {scale} {many}"
    if frac and (sub_one is None or len(frac) > 2):
        return f"{sign}{number(whole + '.' + frac)} {many}"
    units, cents = int(whole), int(frac.ljust(2, "0")) if frac else 0
    parts = []
    if units or not cents:
        parts.append(f"{cardinal(units)} {one if units == 1 else many}")
    if cents:
        parts.append(f"{cardinal(cents)} {sub_one if cents == 1 else sub_many}")
    return sign + " and ".join(parts)


def _unit(match: re.Match) -> str:
    value, unit = match.groups()
    one, many = _UNITS[unit]
    return f"{number(value)} {one if value == '1' else many}"


def _code_money(match: re.Match) -> str:
    value, code = match.groups()
    one, many = _CODES[code]
    return f"{number(value)} {one if value == '1' else many}"


def _spell_address(match: re.Match) -> str:
    text = re.sub(r"^https?://", "", match[0], flags=re.IGNORECASE)
    words = []
    for token in re.findall(r"[A-Za-z]+|\d+|[^\sA-Za-z\d]", text):
        if token.isdigit():
            words.append(digits(token))
        elif token.lower() == "www":
            words.append("w w w")
        elif token.isalpha():
            words.append(token)
        else:
            words.append(
                {
                    ".": "dot",
                    "/": "slash",
                    "@": "at",
                    "-": "dash",
                    "_": "underscore",
                    ":": "colon",
                    "?": "question mark",
                    "=": "equals",
                    "&": "and",
                    "#": "hash",
                    "+": "plus",
                    "~": "tilde",
                    "%": "percent",
                }.get(token, "")
            )
    return " ".join(w for w in words if w)


def _abbreviation(match: re.Match) -> str:
    said = _ABBREVIATIONS[match[0]]
    return said + ("." if match.end() == len(match.string) else "")


def _fraction(match: re.Match) -> str:
    num, den = int(match[1]), int(match[2])
    if den == 2:
        return f"{cardinal(num)} {'half' if num == 1 else 'halves'}"
    if den == 4:
        return f"{cardinal(num)} {'quarter' if num == 1 else 'quarters'}"
    return f"{cardinal(num)} {ordinal(den) if num == 1 else _plural(ordinal(den))}"


_RULES: tuple[tuple[re.Pattern, object], ...] = tuple(
    (re.compile(p, f), r)
    for p, f, r in (
        # addresses first: their dots, digits and symbols must not be read as numbers or sentences
        (
            r"[\w.+-]+@[\w-]+(?:\.[\w-]+)+|\b(?:https?://|www\.)[^\s]*[^\s.,;:!?)\]'\"]"
            r"|\b[\w-]+(?:\.[\w-]+)*\.(?:com|org|net|io|dev|ai|edu|gov)\b(?:/[^\s]*[^\s.,;:!?)\]'\"])?",
            re.IGNORECASE,
            _spell_address,
        ),
        (r"(?<![\w.])No\.\s?(?=\d)", 0, "number "),
        (r"(?<![\w.])(Dr|St)\.", 0, _title_or_street),
        (r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b", 0, _iso_date),
        (r"\b(\d{1,2})[/.](\d{1,2})[/.](\d{4})\b", 0, _numeric_date),
        (r"\b(\d{4})/(\d{1,2})/(\d{1,2})\b", 0, _iso_date),
        (
            rf"\b(?P<month>{_MONTH})\.?\s+(?P<day>\d{{1,2}})(?:st|nd|rd|th)?\b"
            rf"(?:,?\s+(?P<year>\d{{4}})\b)?",
            0,
            _named_date,
        ),
        (
            rf"\b(?P<day>\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?(?P<month>{_MONTH})\b\.?"
            rf"(?:,?\s+(?P<year>\d{{4}})\b)?",
            0,
            _day_first_date,
        ),
        (rf"\b(?P<month>{_MONTH})\.?\s+(?P<year>\d{{4}})\b(?P<day>)", 0, _named_date),
        (
            r"\b(?P<h>[01]?\d|2[0-3]):(?P<m>[0-5]\d)(?::(?P<s>[0-5]\d))?"
            r"(?:\s?(?:(?P<ap>[AaPp])\.[Mm]\.|(?P<ap2>[AaPp])[Mm]\b))?",
            0,
            _time,
        ),
        (
            r"\b(?P<h>1[0-2]|0?[1-9])(?P<m>)(?P<s>)\s?(?:(?P<ap>[AaPp])\.[Mm]\.|(?P<ap2>[AaPp])[Mm]\b)",
            0,
            _time,
        ),
        (
            r"(?<![\w+])(?:\+\d{1,3}[\s.-]?)?(?:\(\d{3}\)\s?|\d{3}[\s.-])\d{3}[\s.-]\d{4}(?!\w)",
            0,
            _phone,
        ),
        (r"(?<![\w+])\+\d{1,3}(?:[\s.-]?\d{2,4}){2,5}(?!\w)", 0, _phone),
        (r"(?<![\w.,])\d{4}(?:[\s-]\d{4}){2,3}(?!\w|[.,]\d)", 0, _phone),
        (r"(?<![\w.-])\d{3}-\d{4}(?![\w-])", 0, _phone),
        (r"(?<![\w.,])(?:0\d+|\d{10,})(?!\w|[.,]\d)", 0, _phone),
        (
            r"(?P<neg>[-\u2212])?(?P<cur>[$€£¥₹₩])\s?(?P<amount>\d{1,3}(?:,\d{3})+|\d+)"
            r"(?:\.(?P<frac>\d+))?(?:\s(?P<scale>thousand|million|billion|trillion)\b"
            r"|(?P<abbr>k|K|mn|m|M|bn|b|B)\b)?",
            0,
            _money,
        ),
        (rf"(?<![\w.])({_NUM})\s?(USD|EUR|GBP|JPY|CNY|RMB)\b", 0, _code_money),
        (r"#\s?(?=\d)", 0, "number "),
        (rf"(-?(?:{_NUM}))\s?%", 0, lambda m: f"{number(m[1])} percent"),
        (r"\b(\d{4})\s?[-–]\s?(?=\d{4}\b)", 0, lambda m: f"{year(int(m[1]))} to "),
        (rf"(?<![\w.])({_NUM})[-–](?=\d)", 0, lambda m: f"{number(m[1])} to "),
        (r"(?<=[A-Za-z])-(?=\d)", 0, " "),
        (r"(?<=\d) - (?=\d)", 0, " minus "),
        (_UNIT_PATTERN, 0, _unit),
        (r"\b(\d+)(?:st|nd|rd|th)\b", re.IGNORECASE, lambda m: ordinal(int(m[1]))),
        (r"\b(1[1-9]|20)(\d)0'?s\b", 0, lambda m: _plural(year(int(m[1] + m[2] + "0")))),
        (r"(?<![\w])'([1-9])0s\b", 0, lambda m: _plural(_TENS[int(m[1])])),
        (
            rf"\b((?i:{_YEAR_CUES})\s+)(1[1-9]\d\d|20\d\d)\b(?![.,]\d)",
            0,
            lambda m: m[1] + year(int(m[2])),
        ),
        (
            r"(?<![\w,.])(1[1-9]\d\d|20\d\d)(?=\s*(?:[.,;:!?)\]]|$))(?![.,]\d)",
            0,
            lambda m: year(int(m[1])),
        ),
        (r"(?<![\w/.])([1-9])/([2-9]|10)(?![\w/])", 0, _fraction),
        (r"(?<=\d)\s?[x×]\s?(?=\d)", 0, " by "),
        (r"(?<=\d)x\b", 0, " times"),
        (r"(?<![\w.])[-\u2212](?=\d|\.\d)", 0, "minus "),
        (_NUM, 0, lambda m: f" {number(m[0])} "),
    )
)


_PUNCTUATION_MAP: dict[str, str | int | None] = {
    "‘": "'",
    "’": "'",
    "“": '"',
    "”": '"',
    "—": ", ",
    "…": "...",
    "\t": " ",
    "\n": " ",
    "\r": " ",
}
_PUNCTUATION = str.maketrans(_PUNCTUATION_MAP)


def normalize_en(text: str) -> str:
    """English text with every number, date, amount, unit, abbreviation and symbol in words."""
    text = re.sub(r"(\d)\s?([½¼¾⅓⅔])", lambda m: f"{m[1]} and {_VULGAR[m[2]]}", text)
    text = "".join(f" {_VULGAR[c]} " if c in _VULGAR else c for c in text)
    text = unicodedata.normalize("NFKC", text).replace("\u2044", "/")
    text = text.translate(_PUNCTUATION)
    for pattern, repl in _RULES:
        text = pattern.sub(repl, text)
    text = _ABBREV_RE.sub(_abbreviation, text)
    text = re.sub(r"#(?=[A-Za-z])", "hashtag ", text)
    text = text.replace("and/or", "and or")
    text = "".join(_SYMBOLS.get(c, c) for c in text)
    text = re.sub(r"\s+", " ", text)
    return re.sub(r" ([,.;:!?])", r"\1", text).strip()
