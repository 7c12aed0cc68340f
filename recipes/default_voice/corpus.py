"""Sentence corpora written here: templated English and Mandarin text, seeded and varied."""

from __future__ import annotations

import random

_ONES = (
    "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
    "sixteen seventeen eighteen nineteen".split()
)
_TENS = "_ _ twenty thirty forty fifty sixty seventy eighty ninety".split()


def number_words(n: int) -> str:
    """0..999 spelled the way both teachers read digits."""
    if n < 20:
        return _ONES[n]
    if n < 100:
        return _TENS[n // 10] + ("" if n % 10 == 0 else " " + _ONES[n % 10])
    rest = n % 100
    return _ONES[n // 100] + " hundred" + ("" if rest == 0 else " " + number_words(rest))


_NAMES = (
    "Anna Peter Mary John Laura David Susan Tom Emma James Lucy Mark Alice Robert Helen Paul Kate "
    "Henry Sarah George Linda Frank Grace Daniel Rose Michael Nancy Steven Julia".split()
)
_NOUNS = (
    "book car house garden river city window letter table phone dog cat horse bird tree road "
    "bridge train ship island mountain kitchen school market office doctor teacher student "
    "friend family child picture song story question answer problem idea plan meeting "
    "morning evening weekend winter summer machine computer engine paper bottle basket "
    "coffee bread apple orange dinner lunch breakfast ticket station airport hotel museum "
    "village forest beach ocean lake castle tower street corner door key chair bed lamp "
    "clock camera radio engine wheel box bag coat shirt hat shoe glass cup plate knife"
).split()
_ADJS = (
    "big small old new red green blue quiet loud bright dark cold warm happy tired busy "
    "strange simple heavy light early late long short young clean empty full fresh "
    "famous careful honest gentle quick slow beautiful difficult easy important"
).split()
_VERBS_PAST = (
    "found opened closed painted cleaned bought sold carried watched visited fixed "
    "borrowed moved washed read wrote built needed wanted liked forgot remembered "
    "dropped pushed pulled checked packed ordered followed noticed described"
).split()
_VERBS_BASE = (
    "find open close paint clean buy sell carry watch visit fix borrow move wash read "
    "write build need want like forget remember check pack order follow describe"
).split()
_PLACES = (
    "at home",
    "in the park",
    "near the station",
    "by the river",
    "in the kitchen",
    "at the market",
    "on the bridge",
    "behind the school",
    "under the tree",
    "in the city",
    "at the office",
    "on the island",
    "in the village",
    "at the airport",
    "in the garden",
)
_TIMES = (
    "yesterday",
    "today",
    "last night",
    "this morning",
    "on Monday",
    "on Friday",
    "at noon",
    "in the evening",
    "every day",
    "last week",
    "tomorrow",
    "next summer",
    "after lunch",
    "before dinner",
    "in the winter",
)
_ADVS = (
    "quickly",
    "slowly",
    "carefully",
    "quietly",
    "suddenly",
    "finally",
    "almost",
    "really",
    "never",
    "always",
    "often",
    "sometimes",
)
_WH = ("where", "when", "why", "how")


def _a(word: str) -> str:
    return ("an " if word[0] in "aeiou" else "a ") + word


def english_sentence(rng: random.Random) -> tuple[str, str]:
    """(text for the teacher, the same words spelled out for scoring)."""
    name, name2 = rng.sample(_NAMES, 2)
    n1, n2 = rng.sample(_NOUNS, 2)
    adj, adj2 = rng.sample(_ADJS, 2)
    vp, vb = rng.choice(_VERBS_PAST), rng.choice(_VERBS_BASE)
    place, time, adv, wh = (
        rng.choice(_PLACES),
        rng.choice(_TIMES),
        rng.choice(_ADVS),
        rng.choice(_WH),
    )
    num = rng.choice([rng.randint(2, 20), rng.randint(21, 99), rng.randint(100, 999)])
    k = rng.randrange(16)
    if k == 0:
        s = f"{name} {vp} the {adj} {n1} {place}."
    elif k == 1:
        s = f"{wh.capitalize()} did {name} {vb} the {n1}?"
    elif k == 2:
        s = f"There are {num} {n1}s {place}."
    elif k == 3:
        s = f"{time.capitalize()}, {name} and {name2} {vp} {_a(adj)} {n2}."
    elif k == 4:
        s = f"Can you {vb} the {n1} {time}?"
    elif k == 5:
        s = f"The {n1} is {adv} {adj}."
    elif k == 6:
        s = f"{name} {adv} {vp} the {n1}, but the {n2} was too {adj}."
    elif k == 7:
        s = f"I think we should {vb} {_a(adj)} {n1} {place} {time}."
    elif k == 8:
        s = f"Is the {n1} {adj} or {adj2}?"
    elif k == 9:
        s = f"She paid {num} dollars for the {n1}."
    elif k == 10:
        s = f"{name} said that the {n1} {place} was {adj}."
    elif k == 11:
        s = f"Please {vb} the {adj} {n1}."
    elif k == 12:
        s = f"We {vp} {num} {n1}s {time}."
    elif k == 13:
        s = f"Why is the {n1} so {adj}?"
    elif k == 14:
        s = f"{name} {vp} {_a(n1)}."
    else:
        s = f"After the {n1}, {name} {vp} the {adj} {n2} {place} and went home {adv}."
    spoken = s.replace(str(num), number_words(num)) if str(num) in s else s
    return s, spoken


def english_corpus(count: int, seed: int) -> list[tuple[str, str]]:
    """`count` distinct English sentences."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < count:
        s = english_sentence(rng)
        if s[0] not in seen:
            seen.add(s[0])
            out.append(s)
    return out


_ZH_SUBJ = "我 你 他 她 我们 他们 老师 学生 妈妈 爸爸 朋友 医生 小王 小李 哥哥 姐姐 孩子们".split()
_ZH_OBJ = "书 苹果 咖啡 衣服 电脑 自行车 房子 花 茶 面包 报纸 电影 音乐 汽车 手机 雨伞 水果 礼物 照片 鸡蛋".split()
_ZH_VERB = "买 看 喜欢 需要 找到 带来 送给 准备 拿走 打开 洗 做".split()
_ZH_PLACE = (
    "在家里 在公园 在学校 在商店 在北京 在上海 在火车站 在图书馆 在医院 在饭店 在办公室".split()
)
_ZH_TIME = "今天 明天 昨天 早上 晚上 星期一 星期五 周末 下午 去年 现在".split()
_ZH_ADJ = "很好 很大 很小 很贵 很便宜 很漂亮 很忙 很冷 很热 很快 很慢 很高兴 很有意思".split()
_ZH_DIGITS = "零一二三四五六七八九"


def chinese_number(n: int) -> str:
    """1..999 in characters."""
    h, t, o = n // 100, (n // 10) % 10, n % 10
    out = ""
    if h:
        out += _ZH_DIGITS[h] + "百"
        if t == 0 and o:
            out += "零"
    if t:
        out += ("" if (t == 1 and not h) else _ZH_DIGITS[t]) + "十"
    if o:
        out += _ZH_DIGITS[o]
    return out


def chinese_sentence(rng: random.Random) -> str:
    """One templated Mandarin sentence in characters."""
    s, s2 = rng.sample(_ZH_SUBJ, 2)
    o, v, p, t, a = (rng.choice(x) for x in (_ZH_OBJ, _ZH_VERB, _ZH_PLACE, _ZH_TIME, _ZH_ADJ))
    num = chinese_number(
        rng.choice([rng.randint(2, 10), rng.randint(11, 99), rng.randint(100, 999)])
    )
    k = rng.randrange(10)
    return [
        f"{t}{s}{p}{v}{o}。",
        f"{s}{v}{o}吗？",
        f"这个{o}{a}。",
        f"{s}有{num}个{o}。",
        f"{s}和{s2}{t}{p}。",
        f"{s}为什么不{v}{o}？",
        f"{t}的天气{a}。",
        f"{s}说{o}{a}，可是{s2}不{v}。",
        f"请你{v}这个{o}。",
        f"{s}花了{num}块钱{v}{o}。",
    ][k]


def chinese_corpus(count: int, seed: int) -> list[str]:
    """`count` distinct Mandarin sentences."""
    rng, seen, out = random.Random(seed), set(), []
    while len(out) < count:
        s = chinese_sentence(rng)
        if s not in seen:
            seen.add(s)
            out.append(s)
    return out


def to_pinyin(text: str) -> str:
    """Characters -> tone-numbered pinyin syllables, the input espeak-ng `cmn-latn-pinyin` reads."""
    from pypinyin import Style, lazy_pinyin

    punct = {"。": ".", "？": "?", "，": ",", "！": "!"}
    out: list[str] = []
    # keep sentence punctuation so pauses and intonation stay
    for piece in _split_keep_punct(text, punct):
        if piece in punct:
            if out:
                out[-1] += punct[piece]
        else:
            out.extend(
                lazy_pinyin(piece, style=Style.TONE3, neutral_tone_with_five=True, errors="ignore")
            )
    return " ".join(out)


def _split_keep_punct(text: str, punct: dict[str, str]) -> list[str]:
    pieces, cur = [], ""
    for ch in text:
        if ch in punct:
            if cur:
                pieces.append(cur)
            pieces.append(ch)
            cur = ""
        else:
            cur += ch
    if cur:
        pieces.append(cur)
    return pieces
